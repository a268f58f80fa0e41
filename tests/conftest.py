import os

import pytest
import torch

from engine_checkpoints import build_hf_model, save_checkpoint

# Without a GPU, Triton kernels run through the interpreter on CPU tensors (fuselab.device does the
# same; set it here too so it holds before any test module imports triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu-check on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    """The device kernel tests run on: CUDA when present, else the CPU through Triton's interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def hf_model():
    """A tiny random Llama 3 in transformers, one per test module (a module may define its own)."""
    return build_hf_model("llama3")


@pytest.fixture(scope="module")
def checkpoint(hf_model, tmp_path_factory):
    """hf_model saved as a checkpoint directory, one per test module (a module may define its own)."""
    return save_checkpoint(hf_model, tmp_path_factory.mktemp("llama3") / "ckpt")
