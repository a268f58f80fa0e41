"""fuselab.graphs: bucket arithmetic, the fallback decision and argument checks on the CPU; capture,
replay, fallbacks, capture errors, output aliasing and the shared pool on a CUDA GPU."""

import argparse
import inspect
import warnings

import pytest
import torch

from fuselab.graphs import (
    ArgSpec,
    CallSignature,
    GraphCaptureError,
    GraphFallbackWarning,
    bucket_for,
    default_buckets,
    describe_call,
    explain_capture_error,
    fallback_reason,
    graphed,
    validate_buckets,
)

CUDA = torch.device("cuda")


# --------------------------------------------------------------------------------------------
# Buckets (CPU)
# --------------------------------------------------------------------------------------------


def test_default_buckets_double_to_8_then_step_by_8():
    assert default_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert default_buckets(8) == (1, 2, 4, 8)
    assert default_buckets(1) == (1,)
    assert default_buckets(3) == (1, 2, 3)
    assert default_buckets(20) == (1, 2, 4, 8, 16, 20)  # the maximum is always served
    assert len(default_buckets(136)) == 20


@pytest.mark.parametrize("bad", [0, -8, 2.0, True, "64", None])
def test_default_buckets_rejects_bad_max(bad):
    with pytest.raises(ValueError, match="max_batch_size"):
        default_buckets(bad)


def test_validate_buckets_sorts_and_drops_repeats():
    assert validate_buckets([8, 1, 4, 4]) == (1, 4, 8)
    assert validate_buckets(range(1, 4)) == (1, 2, 3)


@pytest.mark.parametrize("bad", [[], [0], [1, -2], [1.5], [True], ["8"]])
def test_validate_buckets_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="batch_sizes"):
        validate_buckets(bad)


@pytest.mark.parametrize("bad", [None, 8, "1,2"])
def test_validate_buckets_rejects_non_lists(bad):
    with pytest.raises(TypeError, match="batch_sizes"):
        validate_buckets(bad)


@pytest.mark.parametrize(
    "batch, bucket", [(0, 1), (1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (16, 16), (17, 24), (63, 64), (64, 64), (65, None)]
)
def test_bucket_for_picks_the_smallest_bucket_that_fits(batch, bucket):
    assert bucket_for(batch, default_buckets(64)) == bucket


# --------------------------------------------------------------------------------------------
# Call signatures and the fallback decision (CPU)
# --------------------------------------------------------------------------------------------


def _signature(batch=4, shape=(16,), dtype=torch.float32, address=1000, scale=0.5, needs_grad=False, device=CUDA):
    """A call signature as a CUDA call would have it, built by hand so it can be judged on the CPU."""
    return CallSignature(
        batch=batch,
        args=(
            ArgSpec(0, "batched", shape, dtype=dtype, device=device),
            ArgSpec(1, "static", (16, 16), (16, 1), torch.float32, device, address),
            ArgSpec("scale", "constant", value=scale),
        ),
        needs_grad=needs_grad,
    )


def test_describe_call_sorts_batched_static_and_constant_arguments():
    x, w = torch.randn(5, 3), torch.randn(3, 3)
    call = describe_call((x, w), {"scale": 2.0}, frozenset({1}))
    assert call.batch == 5
    assert [(s.key, s.kind) for s in call.args] == [(0, "batched"), (1, "static"), ("scale", "constant")]
    assert call.args[0].shape == (3,)
    assert call.args[1].address == w.data_ptr()
    assert not call.needs_grad


def test_describe_call_rejects_disagreeing_batches_and_names_both_arguments():
    with pytest.raises(ValueError, match=r"0.*5 rows.*'y'.*3.*static"):
        describe_call((torch.randn(5, 2),), {"y": torch.randn(3, 2)}, frozenset())


def test_describe_call_rejects_calls_it_cannot_graph():
    with pytest.raises(ValueError, match="0-dim"):
        describe_call((torch.randn(4, 2), torch.tensor(1.0)), {}, frozenset())
    with pytest.raises(TypeError, match="no batched tensor"):
        describe_call((torch.randn(4, 2),), {}, frozenset({0}))
    with pytest.raises(TypeError, match="container"):
        describe_call((torch.randn(4, 2), [torch.randn(4, 2)]), {}, frozenset())


def test_describe_call_needs_grad_only_while_grad_is_enabled():
    x = torch.randn(4, 2, requires_grad=True)
    assert describe_call((x,), {}, frozenset()).needs_grad
    with torch.no_grad():
        assert not describe_call((x,), {}, frozenset()).needs_grad


def test_no_fallback_for_a_call_the_graphs_serve():
    assert fallback_reason(_signature(batch=4), None, 8) is None
    assert fallback_reason(_signature(batch=4), _signature(batch=8), 8) is None  # only the batch differs
    assert fallback_reason(_signature(batch=8), _signature(batch=1), 8) is None


def test_fallback_for_tensors_off_cuda():
    reason = fallback_reason(_signature(device=torch.device("cpu")), None, 8)
    assert reason.cause == "device" and "cpu" in reason.detail
    call = describe_call((torch.randn(4, 2),), {}, frozenset())
    assert fallback_reason(call, None, 8).cause == "device"


def test_fallback_for_a_batch_above_the_largest_bucket():
    reason = fallback_reason(_signature(batch=9), _signature(), 8)
    assert reason.cause == "batch" and "9" in reason.detail and "8" in reason.detail


def test_fallback_when_autograd_would_record():
    assert fallback_reason(_signature(needs_grad=True), None, 8).cause == "autograd"


@pytest.mark.parametrize(
    "changed, words",
    [
        (dict(shape=(32,)), "shape after dim 0"),
        (dict(dtype=torch.float16), "dtype"),
        (dict(address=2000), "update them in place"),
        (dict(scale=0.25), "constants"),
        (dict(scale=1), "constants"),  # an int is not the float it equals: it captures other kernels
    ],
)
def test_fallback_when_the_signature_changed_since_capture(changed, words):
    reason = fallback_reason(_signature(**changed), _signature(), 8)
    assert reason.cause == "signature" and words in reason.detail


def test_fallback_when_arguments_are_passed_differently():
    by_position = CallSignature(4, (ArgSpec(0, "batched", (2,), dtype=torch.float32, device=CUDA),), False)
    by_keyword = CallSignature(4, (ArgSpec("x", "batched", (2,), dtype=torch.float32, device=CUDA),), False)
    reason = fallback_reason(by_keyword, by_position, 8)
    assert reason.cause == "signature" and "arguments given changed" in reason.detail


# --------------------------------------------------------------------------------------------
# Capture error messages (CPU)
# --------------------------------------------------------------------------------------------


def _capture_failure(first: str, then: str) -> RuntimeError:
    """The chain a failed capture raises: capture_end's error while handling fn's own."""
    try:
        try:
            raise RuntimeError(first)
        except RuntimeError:
            raise RuntimeError(then)
    except RuntimeError as err:
        return err


def test_capture_error_names_a_host_sync_and_the_fix():
    err = _capture_failure(
        "CUDA error: operation not permitted when stream is capturing",
        "CUDA error: operation failed due to a previous error during capture",
    )
    message = explain_capture_error(err, "step", 64)
    assert ".item()" in message and "Fix:" in message and "step" in message and "64" in message
    assert "CUDA said: CUDA error: operation not permitted" in message  # the first error, not capture_end's


def test_capture_error_names_out_of_memory():
    message = explain_capture_error(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), "f", 8)
    assert "max_batch_size" in message


def test_capture_error_without_a_known_cause_still_quotes_cuda():
    message = explain_capture_error(RuntimeError("something odd\nmore lines"), "f", 8)
    assert "something odd" in message and "more lines" not in message


# --------------------------------------------------------------------------------------------
# graphed(): arguments and the CPU fallback
# --------------------------------------------------------------------------------------------


def _affine(x, w, scale=1.0):
    return (x @ w) * scale


def test_graphed_rejects_bad_arguments_naming_them():
    with pytest.raises(TypeError, match="fn must be callable"):
        graphed(42)
    with pytest.raises(ValueError, match="batch_sizes"):
        graphed(_affine, batch_sizes=[])
    with pytest.raises(ValueError, match="max_batch_size"):
        graphed(_affine, max_batch_size=0)
    with pytest.raises(ValueError, match="not both"):
        graphed(_affine, batch_sizes=[1, 2], max_batch_size=2)
    with pytest.raises(ValueError, match="static_argnames.*'v'"):
        graphed(_affine, static_argnames=["v"])
    with pytest.raises(ValueError, match="static_argnums"):
        graphed(_affine, static_argnums=[3])
    with pytest.raises(ValueError, match="static_argnums"):
        graphed(_affine, static_argnums=[-1])
    with pytest.raises(TypeError, match="copy_outputs"):
        graphed(_affine, copy_outputs="yes")


def test_graphed_keeps_the_name_and_signature_of_fn():
    g = graphed(_affine, static_argnums=[1])
    assert g.__name__ == "_affine"
    assert inspect.signature(g) == inspect.signature(_affine)
    assert g.buckets == default_buckets(64)


def test_a_static_mark_by_position_covers_the_keyword_spelling():
    g = graphed(_affine, static_argnums=[1])
    call = describe_call((torch.randn(4, 2),), {"w": torch.randn(2, 2)}, g._static_keys)
    assert call.args[1].kind == "static"


def test_cpu_calls_run_eagerly_and_warn_once():
    g = graphed(_affine, static_argnames=["w"], max_batch_size=8)
    w = torch.randn(3, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in (1, 5, 8, 20):
            x = torch.randn(batch, 3)
            torch.testing.assert_close(g(x, w, scale=2.0), _affine(x, w, 2.0), rtol=0, atol=0)
    fallback_warnings = [w for w in caught if issubclass(w.category, GraphFallbackWarning)]
    assert len(fallback_warnings) == 1
    assert "cpu" in str(fallback_warnings[0].message)
    assert fallback_warnings[0].filename == __file__  # points at the caller, not at fuselab
    assert g.stats.eager_calls == 4 and g.stats.replays == 0 and g.stats.fallbacks == {"device": 4}
    assert not g.stats.captured


def test_cpu_fallback_returns_every_output_structure_unchanged():
    g = graphed(lambda x: {"y": x + 1, "pair": (x, x * 2)})
    x = torch.randn(3, 2)
    with pytest.warns(GraphFallbackWarning):
        out = g(x)
    assert set(out) == {"y", "pair"} and out["pair"][0] is x


def test_bench_graphs_exits_cleanly_without_cuda(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("the no-GPU path only runs without CUDA")
    from fuselab.bench import graphs as bench_graphs

    parser = argparse.ArgumentParser()
    bench_graphs.add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path / "results")])
    assert bench_graphs.run(args) == 0
    assert "CUDA GPU" in capsys.readouterr().out
    assert not (tmp_path / "results").exists()


def test_bench_graphs_rejects_bad_batch_sizes():
    from fuselab.bench import graphs as bench_graphs

    parser = argparse.ArgumentParser()
    bench_graphs.add_arguments(parser)
    assert parser.parse_args(["--batch-sizes", "1,3,64"]).batch_sizes == [1, 3, 64]
    with pytest.raises(SystemExit):
        parser.parse_args(["--batch-sizes", "1,0"])


def _bench_result(with_compile: bool) -> dict:
    """A result shaped as fuselab.bench.graphs.measure() returns it, with made-up numbers."""
    from fuselab.device import device_info

    rows = []
    for batch in (1, 2, 4):
        mode = lambda us, launches: {"median_us": us, "kernels": 128, "launches": launches}  # noqa: E731
        rows.append({
            "batch": batch, "compile_s": 3.0 if with_compile else None, "graphed_max_diff": 0.0,
            "compiled_max_diff": 0.01 if with_compile else None,
            "graphed_compiled_max_diff": 0.01 if with_compile else None,
            "eager": mode(700.0, 128), "graphed": mode(120.0 + batch, 2), "compiled": mode(140.0, 1) if with_compile else None,
            "graphed_compiled": mode(110.0, 2) if with_compile else None,
            "graphed_speedup": 700.0 / (120.0 + batch), "compiled_speedup": 5.0 if with_compile else None,
            "graphed_compiled_speedup": 700.0 / 110.0 if with_compile else None,
        })
    return {
        "header": {"date": "2026-01-01T00:00:00+00:00", "device": device_info().to_dict(), "command": "fuselab bench graphs"},
        "config": {"layers": 64, "width": 128, "dtype": "bfloat16", "batch_sizes": [1, 2, 4], "rep_ms": 200.0,
                   "workload": "64 x (Linear(128, 128) + SiLU)"},
        "graphed": {"buckets": [1, 2, 4], "capture_s": 0.5, "held_bytes": 2**21, "eager_calls": 0},
        "compiled": {"sizes_recorded": 3, "compile_s": 9.0} if with_compile else None,
        "graphed_compiled": {"capture_s": 8.0, "held_bytes": 2**21} if with_compile else None,
        "rows": rows,
    }


def test_bench_graphs_modes_take_turns_in_rotated_order(monkeypatch):
    from fuselab.bench import graphs as bench_graphs

    order = []

    class FakeResult:
        def __init__(self, us):
            self.median_us = us

    def fake_bench(fn, rep_ms, flush_l2):
        order.append(fn())
        return FakeResult(10.0 * len(order))

    monkeypatch.setattr(bench_graphs, "bench", fake_bench)
    rounds = bench_graphs.interleaved_medians({"a": lambda: "a", "b": lambda: "b", "c": lambda: "c"}, rounds=3, rep_ms=30)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert rounds == {"a": [10.0, 60.0, 80.0], "b": [20.0, 40.0, 90.0], "c": [30.0, 50.0, 70.0]}


def test_bench_graphs_table_shows_the_spread_of_rounds():
    from fuselab.bench import graphs as bench_graphs

    assert bench_graphs._time_cell({"median_us": 121.04, "rounds_us": [119.6, 121.04, 130.2]}) == "121.0 (120–130)"
    assert bench_graphs._time_cell({"median_us": 121.04}) == "121.0"
    assert bench_graphs._time_cell(None) == "—"


@pytest.mark.parametrize("with_compile", [True, False])
def test_bench_graphs_reports_a_result(tmp_path, capsys, with_compile):
    from fuselab.bench import graphs as bench_graphs

    result = _bench_result(with_compile)
    bench_graphs.print_table(result)
    bench_graphs.write_markdown(result, tmp_path / "graphs.md")
    bench_graphs.write_plot(result, tmp_path / "graphs.png")
    printed, markdown = capsys.readouterr().out, (tmp_path / "graphs.md").read_text()
    assert "121.0" in printed and "| 1 | 700.0 | 121.0 |" in markdown and "fuselab bench graphs" in markdown
    assert ("compile + record for 3 sizes" in markdown) == with_compile
    assert ("graphed(torch.compile(model)): compile + capture of every bucket in 8.00 s" in markdown) == with_compile
    assert (tmp_path / "graphs.png").stat().st_size > 0


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------


def _mlp(x, w1, w2, b2):
    return torch.relu(x @ w1) @ w2 + b2


def _mlp_weights(width=64, hidden=128):
    g = torch.Generator(device="cuda").manual_seed(0)
    return (
        torch.randn(width, hidden, device="cuda", generator=g) / width**0.5,
        torch.randn(hidden, width, device="cuda", generator=g) / hidden**0.5,
        torch.randn(width, device="cuda", generator=g),
    )


@pytest.mark.gpu
def test_replay_equals_eager_for_every_bucket_and_every_size_between():
    weights = _mlp_weights()
    g = graphed(_mlp, max_batch_size=40, static_argnums=[1, 2, 3])
    with torch.no_grad():
        for batch in range(1, 41):
            x = torch.randn(batch, 64, device="cuda")  # fresh each call: a stale buffer would show
            out = g(x, *weights)
            assert out.shape == (batch, 64)
            torch.testing.assert_close(out, _mlp(x, *weights), rtol=1e-4, atol=1e-4)
    assert g.stats.captured and g.stats.buckets == (1, 2, 4, 8, 16, 24, 32, 40)
    assert g.stats.replays == 40 and g.stats.eager_calls == 0
    assert g.stats.capture_s > 0 and g.stats.pool_allocated_bytes > 0
    assert g.stats.input_buffer_bytes == 40 * 64 * 4


@pytest.mark.gpu
def test_replay_serves_modules_keywords_and_structured_outputs():
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64, device="cuda"), torch.nn.GELU(), torch.nn.Linear(64, 32, device="cuda")
    ).eval()

    def heads(x, *, shift):
        y = model(x + shift)
        return {"y": y, "pair": (y.sum(dim=1), x * 2)}

    g = graphed(heads, batch_sizes=[4, 16])
    with torch.no_grad():
        for batch in (3, 4, 11, 16):
            x = torch.randn(batch, 32, device="cuda")
            out, expected = g(x, shift=0.5), heads(x, shift=0.5)
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert g.stats.replays == 4


@pytest.mark.gpu
def test_replay_runs_fuselab_triton_kernels():
    from fuselab.kernels import rms_norm

    weight = torch.randn(256, device="cuda")
    g = graphed(lambda x, residual, w: rms_norm(x, w, residual=residual), max_batch_size=16, static_argnames=["w"])
    for batch in (1, 7, 16):
        x, r = torch.randn(batch, 256, device="cuda"), torch.randn(batch, 256, device="cuda")
        torch.testing.assert_close(g(x, r, weight), rms_norm(x, weight, residual=r))
    assert g.stats.replays == 3


@pytest.mark.gpu
def test_a_capture_inside_inference_mode_serves_calls_outside_it():
    g = graphed(lambda x: x * 2, max_batch_size=4)
    with torch.inference_mode():
        x = torch.randn(3, 2, device="cuda")
        torch.testing.assert_close(g(x), x * 2)
    x = torch.randn(2, 2, device="cuda")
    torch.testing.assert_close(g(x), x * 2)
    assert g.stats.replays == 2


@pytest.mark.gpu
def test_fallbacks_run_eagerly_warn_once_and_keep_the_graphs():
    g = graphed(lambda x, s: x * s + 1, max_batch_size=8, static_argnums=[1])
    s = torch.tensor(3.0, device="cuda")
    g(torch.randn(4, 5, device="cuda"), s)
    assert g.stats.captured
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in (torch.randn(9, 5, device="cuda"), torch.randn(30, 5, device="cuda")):  # above the largest bucket
            torch.testing.assert_close(g(x, s), x * s + 1)
        for x in (torch.randn(4, 6, device="cuda"), torch.randn(2, 7, device="cuda")):  # another non-batch shape
            torch.testing.assert_close(g(x, s), x * s + 1)
        x = torch.randn(4, 5)
        torch.testing.assert_close(g(x, s.cpu()), x * 3 + 1)  # CPU tensors
        other = torch.tensor(2.0, device="cuda")  # a static argument rebound to another tensor
        x = torch.randn(4, 5, device="cuda")
        torch.testing.assert_close(g(x, other), x * 2 + 1)
    causes = [str(w.message) for w in caught if issubclass(w.category, GraphFallbackWarning)]
    assert len(causes) == 3, causes  # batch, signature, device: once each
    assert g.stats.fallbacks == {"batch": 2, "signature": 3, "device": 1}
    x = torch.randn(6, 5, device="cuda")
    torch.testing.assert_close(g(x, s), x * s + 1)  # the graphs still serve the captured signature
    assert g.stats.replays == 2


@pytest.mark.gpu
def test_autograd_calls_run_eagerly():
    g = graphed(lambda x: x * 2, max_batch_size=4)
    x = torch.randn(2, 3, device="cuda", requires_grad=True)
    with pytest.warns(GraphFallbackWarning, match="grad"):
        out = g(x)
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


@pytest.mark.gpu
def test_item_inside_fn_fails_at_capture_with_the_named_error():
    def thresholded(x):
        return x * (x.max().item() > 0)

    g = graphed(thresholded, max_batch_size=4)
    caller_stream = torch.cuda.current_stream()
    with pytest.raises(GraphCaptureError, match=r"\.item\(\)") as info:
        g(torch.randn(2, 3, device="cuda"))
    assert info.value.__cause__ is not None  # the raw CUDA error stays reachable
    assert "thresholded" in str(info.value) and "Fix:" in str(info.value)
    assert torch.cuda.current_stream() == caller_stream
    assert not g.stats.captured
    ok = graphed(lambda x: x + 1, max_batch_size=4)  # capture still works after a failed one
    x = torch.randn(3, 3, device="cuda")
    torch.testing.assert_close(ok(x), x + 1)


@pytest.mark.gpu
def test_outputs_are_views_overwritten_by_the_next_replay():
    g = graphed(lambda x: x * 2, max_batch_size=8)
    first_input, second_input = torch.randn(8, 4, device="cuda"), torch.randn(8, 4, device="cuda")
    first = g(first_input)
    second = g(second_input)
    assert first.data_ptr() == second.data_ptr()
    torch.testing.assert_close(first, second_input * 2)  # the first result now shows the second call's


@pytest.mark.gpu
def test_copy_outputs_returns_tensors_the_next_replay_leaves_alone():
    g = graphed(lambda x: (x * 2, x + 1), max_batch_size=8, copy_outputs=True)
    first_input = torch.randn(8, 4, device="cuda")
    first = g(first_input)
    g(torch.randn(8, 4, device="cuda"))
    torch.testing.assert_close(first, (first_input * 2, first_input + 1))


@pytest.mark.gpu
def test_twenty_buckets_share_one_pool():
    width, layers = 4096, 16
    layer = lambda: (torch.nn.Linear(width, width, device="cuda"), torch.nn.ReLU())  # noqa: E731
    model = torch.nn.Sequential(*[m for _ in range(layers) for m in layer()]).eval()
    buckets = default_buckets(136)
    assert len(buckets) == 20
    g = graphed(model, batch_sizes=buckets)
    with torch.no_grad():
        x = torch.randn(100, width, device="cuda")
        torch.testing.assert_close(g(x), model(x), rtol=1e-4, atol=1e-4)
    # Every layer's output at the largest bucket: 34 MiB. One shared pool holds each bucket's output
    # (19 MiB in all) and the largest bucket's transients: about 60 MiB in 2 and 20 MiB segments.
    # Twenty private pools would hold a 20 MiB segment for each bucket whose activations reach 1 MiB
    # (ten here) and a 2 MiB one for each other: at least 220 MiB, above the bound of 136 MiB.
    largest_activations = layers * buckets[-1] * width * 4
    assert 0 < g.stats.held_bytes <= 4 * largest_activations, (g.stats, largest_activations)
