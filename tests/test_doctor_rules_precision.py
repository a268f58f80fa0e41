"""float32 GEMMs held to the float32/TF32 ceiling, and the TF32/bf16 rule with its expected gain."""

import pytest

import doctor_traces as dt
from fuselab.device import STATED_CEILINGS
from fuselab.doctor import analyze_trace
from fuselab.doctor.precision import RATE_OVER_BF16, matmul_precision, tflops_ceiling

FP32_TFLOPS = 780.0 * 67 / 989
GEMM_FLOPS = 2.0 * dt.SIDE**3


def diagnose_built(builder, tmp_path):
    return analyze_trace(builder.write(tmp_path / "trace.json.gz"), ceilings=STATED_CEILINGS, skip_steps=1)


def test_fp32_gemm_is_measured_against_the_fp32_ceiling(tmp_path):
    d = diagnose_built(dt.host_ahead_fp32_matmul(), tmp_path)
    cost = d.analysis.costs[0]
    assert cost.precision == "fp32" and cost.bound == "compute"
    assert cost.tflops_ceiling == pytest.approx(FP32_TFLOPS)
    assert cost.pct_of_ceiling == pytest.approx(100 * GEMM_FLOPS / (FP32_TFLOPS * 1e6) / 2700.0)
    assert any("TFLOP/s fp32" in e and "datasheet" in e for e in d.evidence)


def test_tf32_rule_fires_on_fp32_gemms_with_its_gain(tmp_path):
    d = diagnose_built(dt.host_ahead_fp32_matmul(), tmp_path)
    (fix,) = [f for f in d.fixes if f.rule == "tf32"]
    assert "set_float32_matmul_precision('high')" in fix.action and "bf16" in fix.action
    assert fix.saving_us == pytest.approx(5400.0 * (1 - RATE_OVER_BF16["fp32"] / RATE_OVER_BF16["tf32"]))
    assert fix.saving_us < d.breakdown["compute"]["us"]
    assert "bf16" not in {f.rule for f in d.fixes}


@pytest.mark.parametrize("builder", [
    lambda: dt.host_ahead_fp32_matmul(kernel_name="sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize256x128x32", kernel_us=400.0),
    lambda: dt.host_ahead_fp32_matmul(kernel_name="nvjet_sm90_sss_256x128_32x4_1x2_h_bz_coopB_NNT", kernel_us=400.0),
    lambda: dt.host_ahead_fp32_matmul(kernel_name="nvjet_sm90_sss_256x128_32x4_1x2_h_bz_coopB_NNT", kernel_us=2700.0,
                                      precision="high"),
], ids=["named tf32", "faster than fp32 can run", "recorded setting"])
def test_tf32_gemm_gets_the_bf16_rule_not_the_tf32_one(tmp_path, builder):
    d = diagnose_built(builder(), tmp_path)
    assert d.analysis.costs[0].precision == "tf32"
    rules = {f.rule for f in d.fixes}
    assert "bf16" in rules and "tf32" not in rules


def test_recorded_highest_precision_keeps_a_fast_kernel_fp32(tmp_path):
    d = diagnose_built(dt.host_ahead_fp32_matmul(kernel_name="nvjet_sm90_sss", kernel_us=2000.0, precision="highest"), tmp_path)
    assert d.analysis.costs[0].precision == "fp32"


def test_bf16_gemms_fire_no_precision_rule(tmp_path):
    d = analyze_trace(dt.compute_bound().write(tmp_path / "t.json"), ceilings=STATED_CEILINGS)
    assert d.analysis.costs[0].precision == "bf16"
    assert not {f.rule for f in d.fixes} & {"tf32", "bf16"}


def test_small_fp32_gemms_fire_no_precision_rule(tmp_path):
    d = analyze_trace(dt.launch_bound().write(tmp_path / "t.json"), ceilings=STATED_CEILINGS)  # 1x64x64 fp32 mm: memory-bound
    assert not {f.rule for f in d.fixes} & {"tf32", "bf16"}


@pytest.mark.parametrize("types, name, tf32, precision", [
    (["c10::BFloat16", "c10::BFloat16"], "nvjet_sm90_tst", None, "bf16"),
    (["float", "float"], "sm90_xmma_gemm_f32f32_f32f32", None, "fp32"),
    (["float", "float"], "sm90_xmma_gemm_f32f32_tf32f32", None, "tf32"),
    (["float", "float"], "nvjet_sm90_sss", True, "tf32"),
    (["Scalar", "c10::Half"], "gemm", None, "fp16"),
    (["double", "double"], "gemm", None, None),
])
def test_matmul_precision(types, name, tf32, precision):
    assert matmul_precision(types, name, tf32) == precision


def test_ceilings_scale_from_bf16():
    assert tflops_ceiling(STATED_CEILINGS, "tf32") == pytest.approx(780.0 * 495 / 989)
    assert tflops_ceiling(STATED_CEILINGS, None) == 780.0
