"""Which ceilings the rooflines use: a probe's measurement, else stated figures that say whose they are."""

import json

import pytest
import torch

from fuselab import device
from fuselab.device import STATED_CEILINGS, ceilings


@pytest.fixture
def no_probe(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSELAB_PROBE", str(tmp_path / "missing.json"))


def test_a_probe_result_gives_measured_ceilings(tmp_path):
    path = tmp_path / "probe.json"
    path.write_text(json.dumps({"ceilings": {"copy_bandwidth_gbs": 3000.0, "bf16_tflops": 600.0}}))
    c = ceilings(path)
    assert (c.copy_bandwidth_gbs, c.bf16_tflops) == (3000.0, 600.0) and c.source.startswith("measured")


def test_a_named_probe_that_is_missing_says_how_to_make_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="fuselab probe --json"):
        ceilings(tmp_path / "missing.json")


def test_without_a_gpu_the_stated_figures_are_the_h200s(no_probe, monkeypatch):
    monkeypatch.setattr(device, "has_cuda", lambda: False)
    assert ceilings() == STATED_CEILINGS


def test_on_an_h200_the_stated_figures_stand(no_probe, monkeypatch):
    monkeypatch.setattr(device, "has_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    assert ceilings() == STATED_CEILINGS


def test_on_another_gpu_the_stated_figures_say_they_are_not_its_own(no_probe, monkeypatch):
    monkeypatch.setattr(device, "has_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    c = ceilings()
    assert c.copy_bandwidth_gbs == STATED_CEILINGS.copy_bandwidth_gbs
    assert "not this NVIDIA H100 80GB HBM3's" in c.source and "fuselab probe" in c.source
