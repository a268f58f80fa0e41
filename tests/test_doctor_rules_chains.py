"""Known chains mapped to the fix that removes them, each reported once, and fixes that add up to no more than the step."""

import pytest

import doctor_traces as dt
from fuselab.device import STATED_CEILINGS
from fuselab.doctor import analyze_trace
from fuselab.doctor.chains import fix_for
from fuselab.doctor.verdict import verdict_for
from fuselab.doctor.analyze import analyze_file

ADAMW_LABELS = tuple(name.removeprefix("aten::") for name in dt.ADAMW_UPDATE)


def diagnose_built(builder, tmp_path, **kwargs):
    return analyze_trace(builder.write(tmp_path / "trace.json.gz"), ceilings=STATED_CEILINGS, **kwargs)


@pytest.mark.parametrize("annotated", [True, False], ids=["optimizer range", "ops alone"])
def test_per_parameter_adamw_is_one_chain_with_the_fused_optimizer_fix(tmp_path, annotated):
    d = diagnose_built(dt.adamw_loop(annotated=annotated), tmp_path)
    (chain,) = d.analysis.fusion  # every rotation of the update claimed by the first
    assert chain.labels == ADAMW_LABELS and chain.rule == "optimizer"
    assert chain.count == 6 * 3
    assert chain.kernels_us == pytest.approx(6 * 3 * 8 * 2.0)
    assert chain.total_us == pytest.approx(3 * (47 * 10.0 + 2.0))  # one block a step, the gaps between parameters in it
    assert chain.optimizer == ("AdamW" if annotated else None)
    (fix,) = [f for f in d.fixes if f.rule == "optimizer"]
    assert "fuselab.optim.FusedAdamW" in fix.action and "fused=True" in fix.action
    assert fix.alone_us <= 472.0  # never more than the chain's own time


def test_other_optimizers_get_torchs_fused_flag():
    fix = fix_for(("mul_", "add_", "add_"), 2.0, optimizer="SGD")
    assert fix.rule == "optimizer" and "torch.optim.SGD(..., fused=True)" in fix.action and "FusedAdamW" not in fix.action


def test_handwritten_attention_is_one_chain_with_the_sdpa_fix(tmp_path):
    d = diagnose_built(dt.attention(), tmp_path)
    (chain,) = d.analysis.fusion  # the scale and softmax are not offered again as an elementwise chain
    assert chain.labels == ("bmm", "div", "_softmax", "bmm") and chain.rule == "attention" and chain.count == 4 * 3
    assert chain.kernels_us == pytest.approx(4 * 3 * (6.0 + 8.0))
    assert chain.total_us == pytest.approx(4 * 3 * (2 + 6 + 2 + 8 + 2))
    (fix,) = [f for f in d.fixes if f.rule == "attention"]
    assert "scaled_dot_product_attention" in fix.action and "fuselab.kernels.flash_attention" in fix.action
    assert fix.alone_us == pytest.approx(4 * (6 + 8 + 6))  # the kernels on the scores and the gaps between them


def test_sdpa_fires_no_attention_rule(tmp_path):
    d = diagnose_built(dt.attention(fused=True), tmp_path)
    assert d.analysis.fusion == [] and "attention" not in {f.rule for f in d.fixes}


def test_unfused_rms_norm_maps_to_the_fuselab_kernel(tmp_path):
    d = diagnose_built(dt.launch_bound(), tmp_path)
    assert d.analysis.fusion[0].rule == "kernel:rms_norm"
    assert "fuselab.kernels.rms_norm" in next(f.action for f in d.fixes if f.rule == "kernel:rms_norm")


@pytest.mark.parametrize("labels, rule", [
    (("pow", "mean", "add", "rsqrt", "mul", "mul"), "kernel:rms_norm"),
    (("silu", "mul"), "kernel:swiglu"),
    (("_log_softmax", "nll_loss_forward"), "kernel:cross_entropy"),
    (("amax", "sub", "exp", "sum", "div"), "kernel:softmax"),
    (("mul", "neg", "cat", "mul", "add"), "kernel:apply_rope"),
    (("mul", "pow", "mul", "add", "mul", "tanh", "add", "mul"), "kernel:bias_act"),
    (("_foreach_mul_", "_foreach_addcdiv_"), "optimizer"),
    (("exp", "log"), "graph"),
])
def test_known_chains(labels, rule):
    assert fix_for(labels, 2.0).rule == rule


def test_large_unknown_chain_is_one_fused_kernel():
    assert fix_for(("exp", "log"), 200.0).rule == "fusion"


def _builders():
    return [dt.launch_bound, dt.sync_bound, dt.sync_bound_with_sites, dt.memory_bound, dt.compute_bound, dt.graph_replay,
            dt.host_ahead_fp32_matmul, dt.host_to_device_copy, dt.adamw_loop, dt.attention]


@pytest.mark.parametrize("builder", _builders())
@pytest.mark.parametrize("unprofiled", [False, True])
def test_fixes_never_claim_more_than_the_step(tmp_path, builder, unprofiled):
    analysis = analyze_file(builder().write(tmp_path / "t.json"), ceilings=STATED_CEILINGS)
    wall = analysis.steps[0].wall_us
    d = verdict_for(analysis, unprofiled_us=0.8 * wall if unprofiled else None)
    step = sum(p["us"] for p in d.breakdown.values())  # the step judged
    assert sum(f.saving_us for f in d.fixes) <= step * (1 + 1e-9)
    for f in d.fixes:
        assert 0 <= f.saving_us <= f.alone_us + 1e-9
    # Each fix draws on parts of the breakdown: none of them is overdrawn.
    removable = {k: v["us"] for k, v in d.breakdown.items()}
    assert sum(f.saving_us for f in d.fixes if f.rule in ("sync", "blocking-copy")) <= removable["sync_stalls"] + 1e-6
    assert sum(f.saving_us for f in d.fixes if f.rule == "pageable-copy") <= removable["copies"] + 1e-6


def test_each_kernel_belongs_to_one_chain(tmp_path):
    for builder in _builders():
        d = diagnose_built(builder(), tmp_path)
        assert sum(c.kernels_us for c in d.analysis.fusion) <= sum(g.dur for g in d.analysis.trace.gpu) + 1e-6


def test_torchs_fused_optimizer_is_not_offered_a_fused_optimizer():
    assert fix_for(("_foreach_add_", "_fused_adamw_"), 3.0, optimizer="AdamW").rule != "optimizer"


BACKWARD_TAIL = ("aten::sum", "aten::native_layer_norm_backward", "aten::add_", "aten::embedding_dense_backward")


def _backward_then_adamw(steps: int = 3, params: int = 6) -> dt.TraceBuilder:
    """adamw_loop with the end of a backward pass running straight into the optimizer's step on the GPU:
    BACKWARD_TAIL launched just before the optimizer range, its kernels back to back with the update's."""
    b = dt.TraceBuilder()
    for n in range(steps):
        s = 2000.0 * n
        b.step(n, s, 1200.0)
        for j, name in enumerate(BACKWARD_TAIL):
            b.launch(name, s + 10 * j, s + 7 + 10 * j, 2.0, [[256, 256], [256, 256]], ["float", "float"])
        b.annotation("Optimizer.step#AdamW.step", s + 195, 10.0 * params * len(dt.ADAMW_UPDATE) + 10)
        for i in range(params * len(dt.ADAMW_UPDATE)):
            name = dt.ADAMW_UPDATE[i % len(dt.ADAMW_UPDATE)]
            b.launch(name, s + 200 + 10 * i, s + 207 + 10 * i, 2.0, [[256, 256], [256, 256]], ["float", "float"])
    return b


def test_no_chain_crosses_into_the_optimizers_step(tmp_path):
    d = diagnose_built(_backward_then_adamw(), tmp_path)
    optimizer_chains = [c for c in d.analysis.fusion if c.rule == "optimizer"]
    assert [c.labels for c in optimizer_chains] == [ADAMW_LABELS]
    backward = {name.removeprefix("aten::") for name in BACKWARD_TAIL} - set(ADAMW_LABELS)
    assert not [c.labels for c in d.analysis.fusion if c.optimizer and backward & set(c.labels)]
    rules = [f.rule for f in d.fixes]
    assert rules.count("optimizer") == 1, [f.to_dict() for f in d.fixes]
