import argparse
from pathlib import Path

import pytest
import torch

from fuselab.bench import attention as bench_attention


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_attention.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_options_parse():
    args = _args("--seqs", "1024,2048", "--head-dims", "128", "--quick", "--only", "decode", "--out", "somewhere")
    assert args.seqs == [1024, 2048] and args.head_dims == [128] and args.quick and args.only == "decode"
    defaults = _args()
    assert defaults.seqs == [1024, 4096, 16384] and defaults.batches == [1, 8, 64] and defaults.dtype == "bfloat16"
    with pytest.raises(SystemExit):
        _args("--seqs", "1k")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_without_a_gpu_it_says_so_and_succeeds(capsys, tmp_path):
    assert bench_attention.run(_args("--out", str(tmp_path))) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


def test_flop_and_byte_counts():
    assert bench_attention.prefill_flops(1, 1, 1024, 128, causal=False, backward=False) == 4 * 1024**2 * 128
    assert bench_attention.prefill_flops(1, 1, 1024, 128, causal=True, backward=True) == 2 * 1024**2 * 128 * 3.5
    # batch 8, context 4096, 8 kv heads of 128, bf16: keys and values dominate.
    assert bench_attention.decode_bytes(8, 4096, 32, 8, 128, 2) == (2 * 8 * 4096 * 8 * 128 + 2 * 8 * 32 * 128) * 2


def test_torch_decode_reference_agrees_with_the_math_reference(device):
    from fuselab.kernels import reference

    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(2, 6, 16, 2, 16, device=device).unbind(0)
    block_tables = torch.tensor([[4, 1], [0, 5]], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([32, 32], dtype=torch.int32, device=device)
    q = torch.randn(2, 4, 16, device=device)
    expected = reference.decode_attention(q, k_cache, v_cache, block_tables, seq_lens)
    torch.testing.assert_close(bench_attention.torch_decode(q, k_cache, v_cache, block_tables, seq_lens), expected)


def _fake_result() -> dict:
    prefill = [
        {"batch": 8, "heads": 16, "seq": 4096, "head_dim": 128, "causal": True, "pass": "forward", "impl": impl,
         "median_us": us, "tflops": tf, "max_abs_diff": 0.0, "error": err}
        for impl, us, tf, err in (("fuselab", 1000.0, 550.0, None), ("sdpa flash", 1700.0, 313.0, None),
                                  ("sdpa cudnn", 1050.0, 522.0, None), ("sdpa efficient", None, None, "RuntimeError: no"))
    ]
    decode = [
        {"batch": 8, "context": 4096, "impl": impl, "bytes": 134_283_264, "median_us": us, "gbs": 134_283_264 / us / 1e3,
         "pct_of_copy": 134_283_264 / us / 1e3 / 42.3, "max_abs_diff": 0.0, "error": None}
        for impl, us in (("fuselab", 40.0), ("torch sdpa (gathered)", 200.0))
    ]
    return {
        "date": "2026-12-01T00:00:00+00:00", "command": "fuselab bench attention",
        "device": {"name": "GPU", "compute_capability": "9.0", "torch": "2.11", "triton": "3.6", "cuda": "13.0"},
        "ceilings": {"copy_bandwidth_gbs": 4230.0, "source": "stated"},
        "config": {"dtype": "bfloat16", "timing": "median", "decode": "32 heads"},
        "prefill": prefill, "decode": decode,
        "sweep": [{"kernel": "decode", "head_dim": 128, "causal": None,
                   "current": {"block_n": 64, "num_warps": 4, "num_stages": 3},
                   "best": [{"config": {"block_n": 128, "num_warps": 8, "num_stages": 2}, "median_us": 30.0}]}],
    }


def test_tables_show_each_backend_and_the_ratios(tmp_path: Path):
    (row,) = bench_attention.prefill_rows(_fake_result())
    cells = dict(zip(bench_attention.PREFILL_COLUMNS, row))
    assert cells["fuselab"] == "550" and cells["sdpa efficient"] == "unsupported"
    assert cells["vs flash"] == "1.76×" and cells["vs cuDNN"] == "1.05×"
    (drow,) = bench_attention.decode_rows(_fake_result())
    dcells = dict(zip(bench_attention.DECODE_COLUMNS, drow))
    assert dcells["fuselab"].startswith("40.0 µs, 3357 GB/s (79%)") and dcells["speed-up"] == "5.00×"
    bench_attention.write_markdown(_fake_result(), tmp_path / "attention.md")
    text = (tmp_path / "attention.md").read_text()
    assert "GPU: GPU (sm 9.0), torch 2.11, triton 3.6" in text and "| B8 H16 S4096 D128 | yes | forward | 550 |" in text
    assert "decode d=128: current (64, 4, 3), fastest (128, 8, 2) 30.0 µs" in text


def test_sweep_candidates_fit_the_causal_diagonal():
    candidates = bench_attention.forward_candidates() + bench_attention.tma_forward_candidates()
    assert all(c.block_m % c.block_n == 0 for c in candidates)


def test_config_timing_ranks_the_candidates_and_leaves_the_table_as_it_was():
    from typing import NamedTuple

    class Cfg(NamedTuple):
        name: str

    table = {1: Cfg("kept")}
    costs = {"slow": 2.0, "fast": 1.0}  # "big" fails to compile

    def time_us():
        name = table[2].name
        if name not in costs:
            raise RuntimeError("out of resource: shared memory")
        return costs[name]

    timed = bench_attention._time_configs(table, 2, [Cfg("slow"), Cfg("big"), Cfg("fast")], time_us)
    assert [t["config"]["name"] for t in timed] == ["fast", "slow"]
    assert table == {1: Cfg("kept")}  # the key it lacked is left out again
    table[2] = Cfg("current")
    bench_attention._time_configs(table, 2, [Cfg("fast")], time_us)
    assert table[2] == Cfg("current")
    assert len(bench_attention.decode_candidates()) > 1
