import pytest
import torch

from fuselab.kernels.l2_prefetch import prefetch_available, prefetch_l2


def test_prefetch_does_nothing_off_the_gpu_and_changes_nothing():
    t = torch.arange(1000, dtype=torch.float32)
    before = t.clone()
    prefetch_l2(t)
    prefetch_l2(t, start=16, n_bytes=64)
    assert not prefetch_available(t.device)
    assert torch.equal(t, before)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(tensor=[1, 2]), TypeError, "tensor must be a torch.Tensor"),
    (dict(start=-16), ValueError, "start and n_bytes must be >= 0"),
    (dict(n_bytes=-1), ValueError, "start and n_bytes must be >= 0"),
])
def test_bad_arguments_are_named(kwargs, error, match):
    args = dict(tensor=torch.zeros(64))
    args.update(kwargs)
    with pytest.raises(error, match=match):
        prefetch_l2(**args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run scripts/gpu-check on a GPU machine)")
def test_prefetch_runs_on_the_gpu_and_clips_its_range():
    t = torch.randn(3, 1000, device="cuda")
    before = t.clone()
    prefetch_l2(t)
    prefetch_l2(t, start=4096, n_bytes=1 << 30)  # past the end: clipped
    prefetch_l2(t[1])  # a view: its own bytes
    with pytest.raises(ValueError, match="16-byte aligned"):
        prefetch_l2(t.view(-1)[1:])
    torch.cuda.synchronize()
    assert torch.equal(t, before)
