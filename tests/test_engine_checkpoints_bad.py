"""Malformed or unsupported checkpoints: each is refused at load with an error naming the file and
the field or tensor at fault, instead of a library's traceback or silently wrong tokens."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_checkpoints import build_hf_model, save_checkpoint
from fuselab.engine import LLM
from fuselab.engine.config import CheckpointError

NORM = "model.norm.weight"
K_PROJ = "model.layers.1.self_attn.k_proj.weight"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A tiny Llama 3 checkpoint that loads; each test breaks a copy of it."""
    return save_checkpoint(build_hf_model("llama3"), tmp_path_factory.mktemp("good") / "ckpt")


@pytest.fixture
def ckpt(good, tmp_path):
    return shutil.copytree(good, tmp_path / "ckpt")


def _load(path, **kwargs):
    return LLM(path, mode="eager", dtype="float32", max_model_len=64, **kwargs)


def _edit_config(path, **fields):
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **fields}))


def _edit_tensors(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_the_unbroken_checkpoint_loads(ckpt):
    assert _load(ckpt).generate([1, 2, 3])[0].token_ids


@pytest.mark.parametrize("damage", [
    lambda data: data[:len(data) // 2],
    lambda data: bytes(len(data)),
    lambda data: b"",
], ids=["truncated", "zero-filled", "empty"])
def test_unreadable_safetensors_names_the_file(ckpt, damage):
    file = ckpt / "model.safetensors"
    file.write_bytes(damage(file.read_bytes()))
    with pytest.raises(CheckpointError, match=rf"checkpoint {re.escape(str(file))}: not a readable safetensors file"):
        _load(ckpt)


@pytest.mark.parametrize("text, match", [
    ("[1, 2]", "expected a JSON object, got a list"),
    ('{"model_type": "llama",', "not valid JSON"),
])
def test_config_json_that_is_not_an_object_names_the_file(ckpt, text, match):
    (ckpt / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(ckpt / 'config.json'))}: {match}"):
        _load(ckpt)


@pytest.mark.parametrize("fields, match", [
    (dict(architectures=["MixtralForCausalLM"]), r"architectures=\['MixtralForCausalLM'\]"),
    (dict(quantization_config={"quant_method": "gptq", "bits": 8}),
     r"quantization_config \(quant_method='gptq'\): bits=8 is not supported \(only 4\)"),
    (dict(rms_norm_eps="1e-5"), "rms_norm_eps must be a positive number"),
])
def test_unsupported_config_fields_name_the_file_and_field(ckpt, fields, match):
    _edit_config(ckpt, **fields)
    with pytest.raises(CheckpointError, match=rf"config\.json: config field {match}"):
        _load(ckpt)


def test_integer_weights_are_refused(ckpt):
    _edit_tensors(ckpt, lambda t: t.update({NORM: t[NORM].to(torch.int64)}))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor '{NORM}' has dtype I64"):
        _load(ckpt)


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_non_finite_weights_name_the_tensor(ckpt, bad_value):
    def poison(tensors):
        tensors[K_PROJ][3, 5] = bad_value

    _edit_tensors(ckpt, poison)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor '{K_PROJ}' holds NaN or inf"):
        _load(ckpt)


def test_weights_that_overflow_the_models_dtype_are_refused(ckpt):
    def too_large_for_float16(tensors):
        tensors[NORM][0] = 1e6

    _edit_tensors(ckpt, too_large_for_float16)
    _load(ckpt)  # float32 holds it
    with pytest.raises(CheckpointError, match=rf"tensor '{NORM}' holds NaN or inf values \(as float16\)"):
        LLM(ckpt, mode="eager", dtype="float16", max_model_len=64)


def test_mis_shaped_tensor_names_the_file_and_both_shapes(ckpt):
    _edit_tensors(ckpt, lambda t: t.update({NORM: t[NORM][:-1].clone()}))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor '{NORM}' has shape \(63,\), "
                                              r"the model expects \(64,\)"):
        _load(ckpt)


def test_tensor_stored_twice_is_refused(ckpt):
    save_file({NORM: torch.ones(64)}, ckpt / "model-extra.safetensors")
    with pytest.raises(CheckpointError, match=rf"tensor '{NORM}' is also in"):
        _load(ckpt)


def test_malformed_shard_index_names_the_file(ckpt):
    (ckpt / "model.safetensors.index.json").write_text('{"weight_map": ["model.safetensors"]}')
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: field weight_map"):
        _load(ckpt)


@pytest.mark.parametrize("name, text, match", [
    ("tokenizer.json", "{not json", "not a readable tokenizer"),
    ("generation_config.json", "{", "not valid JSON"),
    ("generation_config.json", '{"eos_token_id": "</s>"}', "eos_token_id must be an int"),
])
def test_malformed_side_files_name_the_file(ckpt, name, text, match):
    (ckpt / name).write_text(text)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(ckpt / name))}: .*{match}"):
        _load(ckpt)


def test_model_given_as_the_weights_file_points_at_its_directory(ckpt):
    with pytest.raises(ValueError, match="is a file: pass the checkpoint directory"):
        _load(ckpt / "model.safetensors")
