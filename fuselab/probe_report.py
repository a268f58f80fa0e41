"""How `fuselab probe` shows its result: rich tables in the terminal and a two-panel plot."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def _fmt(value: float, digits: int = 2) -> str:
    return f"{value:,.{digits}f}"


def _figure_rows(result: dict) -> list[tuple[str, str, str, str]]:
    launch = result["launch"]
    rows = [
        ("launch", f"{launch['kernels']} x {launch['tensor']}, eager, one sync at the end", launch["eager_us_per_kernel"], "us/kernel"),
    ]
    if "synced_us_per_kernel" in launch:
        rows += [
            ("launch", "a sync after every launch", launch["synced_us_per_kernel"], "us/kernel"),
            ("graph", "the same chain replayed from one CUDA graph", launch["graph_us_per_kernel"], "us/kernel"),
            ("graph", "eager / graph", launch["eager_over_graph"], "x"),
            ("launch", "launch overhead (eager - graph)", launch["launch_overhead_us"], "us/kernel"),
        ]
    rows += [
        ("launch", "CPU time to issue one launch (no sync)", launch["cpu_issue_us_per_launch"], "us"),
        ("launch", "CPU launch throughput", launch["launches_per_s"], "launches/s"),
        ("launch", f"one kernel doing all {launch['kernels']} kernels' work", launch["one_kernel_equal_work_us"], "us total"),
        ("launch", f"vs the {launch['kernels']} kernels eager", launch["eager_us_per_kernel"] * launch["kernels"], "us total"),
    ]
    sweep = result["size_sweep"]
    if sweep.get("crossover_side"):
        rows.append(("sweep", "kernel time = launch cost at side", sweep["crossover_side"], "elements (fp32, square)"))
    for name, us in result.get("sync", {}).get("idle_device_us", {}).items():
        rows.append(("sync", name, us, "us"))
    ceil = result["ceilings"]
    rows.append(("ceiling", f"device copy, {ceil['copy_bytes'] >> 20} MiB (read + write)", ceil["copy_bandwidth_gbs"], "GB/s"))
    if "bf16_tflops" in ceil:
        rows.append(("ceiling", f"matmul {ceil['gemm']}", ceil["bf16_tflops"], "TFLOP/s"))
    else:
        rows.append(("ceiling", f"matmul {ceil['gemm']} (CPU)", ceil["fp32_tflops_cpu"], "TFLOP/s"))
    rows.append(("ceiling", "ridge point (memory-bound below)", ceil["ridge_flop_per_byte"], "FLOP/byte"))
    streams = result.get("streams")
    if streams:
        rows += [
            ("streams", "H2D pinned", streams["h2d_pinned_gbs"], "GB/s"),
            ("streams", "H2D pageable", streams["h2d_pageable_gbs"], "GB/s"),
            ("streams", "copy + compute on one stream", streams["one_stream_us"], "us"),
            ("streams", "copy + compute on two streams (pinned)", streams["two_streams_us"], "us"),
            ("streams", "overlap achieved, pinned", streams["overlap_pct"], "%"),
            ("streams", "overlap achieved, pageable", streams["pageable_overlap_pct"], "%"),
        ]
    out = [(section, figure, _fmt(value), unit) for section, figure, value, unit in rows]
    if streams:
        out.append(("streams", "cross-stream ordering with an event", "holds" if streams["event_ordering_correct"] else "BROKEN", ""))
    return out


FIGURE_COLUMNS = ("section", "figure", "value", "unit")
SWEEP_COLUMNS = ("side", "MiB moved", "launches", "eager us/kernel", "graph us/kernel", "launch share")


def _sweep_rows(result: dict) -> list[tuple[str, ...]]:
    rows = []
    for r in result["size_sweep"]["rows"]:
        graph = _fmt(r["graph_us_per_kernel"]) if "graph_us_per_kernel" in r else "-"
        share = f"{r['launch_share_pct']:.0f}%" if "launch_share_pct" in r else "-"
        rows.append((str(r["side"]), _fmt(r["bytes"] / 2**20, 1), str(r["launches"]), _fmt(r["eager_us_per_kernel"]), graph, share))
    return rows


COLLECTIVE_COLUMNS = ("size", "latency us", "algbw GB/s", "busbw GB/s")


def _collective_rows(collectives: dict) -> list[tuple[str, ...]]:
    rows = [(f"{r['bytes'] >> 10} KiB" if r["bytes"] < 1 << 20 else f"{r['bytes'] >> 20} MiB",
             _fmt(r["latency_us"], 1), _fmt(r["algbw_gbs"], 1), _fmt(r["busbw_gbs"], 1))
            for r in collectives["all_reduce"]]
    o = collectives["overlap"]
    rows.append((f"{o['bytes'] >> 20} MiB beside a {o['matmul_side']}² matmul",
                 f"{_fmt(o['together_us'], 0)} (alone {_fmt(o['all_reduce_us'], 0)} + {_fmt(o['matmul_us'], 0)})",
                 f"{_fmt(o['hidden_pct'], 0)}% hidden", ""))
    return rows


def _table(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]], left: int = 0) -> Table:
    table = Table(title=title)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i < left else "right")
    for row in rows:
        table.add_row(*row)
    return table


def _markdown_table(columns: tuple[str, ...], rows: list[tuple[str, ...]], left: int = 0) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" if i < left else "---:" for i in range(len(columns))) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def markdown(result: dict) -> str:
    """The same figures as the terminal tables, as Markdown for results files and the README."""
    meta = result["meta"]
    lines = [
        f"# fuselab probe: {meta['name']}",
        "",
        f"{meta['date']}; torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}, Python {meta['python']}; "
        f"command: `{meta['command']}`",
        "",
        *_markdown_table(FIGURE_COLUMNS, _figure_rows(result), left=2),
        "",
        f"Size sweep ({result['size_sweep']['tensor']}):",
        "",
        *_markdown_table(SWEEP_COLUMNS, _sweep_rows(result)),
        "",
        "Verdict:",
        "",
    ]
    lines += [f"- {line}" for line in result["verdict"]]
    lines += [f"- skipped {s['section']}: {s['reason']}" for s in result.get("skipped", [])]
    collectives = result.get("collectives", {})
    if "all_reduce" in collectives:
        lines += ["", f"All-reduce over {collectives['gpus']} GPUs:", "",
                  *_markdown_table(COLLECTIVE_COLUMNS, _collective_rows(collectives))]
    elif "skipped" in collectives:
        lines.append(f"- skipped collectives: {collectives['skipped']}")
    return "\n".join(lines) + "\n"


def render(result: dict, console: Console | None = None) -> None:
    console = console or Console()
    meta = result["meta"]
    title = f"fuselab probe: {meta['name']} (torch {meta['torch']}, triton {meta['triton']})"
    console.print(_table(title, FIGURE_COLUMNS, _figure_rows(result), left=2))
    console.print(_table(f"size sweep: {result['size_sweep']['tensor']}", SWEEP_COLUMNS, _sweep_rows(result)))
    collectives = result.get("collectives", {})
    if "all_reduce" in collectives:
        console.print(_table(f"all-reduce over {collectives['gpus']} GPUs", COLLECTIVE_COLUMNS,
                             _collective_rows(collectives)))
    for skipped in result.get("skipped", []):
        console.print(f"[yellow]skipped[/] {skipped['section']}: {skipped['reason']}")
    if "skipped" in collectives:
        console.print(f"[yellow]skipped[/] collectives: {collectives['skipped']}")
    console.print("[bold]verdict[/]")
    for line in result["verdict"]:
        console.print(f"  - {line}")


def plot(result: dict, path: str) -> None:
    """Left: per-kernel time against size (eager vs graph, the launch cost and the crossover).
    Right: what one launch and one sync cost, on one log axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta = result["meta"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    sweep = result["size_sweep"]
    mib = [r["bytes"] / 2**20 for r in sweep["rows"]]
    left.loglog(mib, [r["eager_us_per_kernel"] for r in sweep["rows"]], "o-", label="eager (launch + kernel)")
    if "graph_us_per_kernel" in sweep["rows"][0]:
        left.loglog(mib, [r["graph_us_per_kernel"] for r in sweep["rows"]], "s-", label="CUDA graph replay (kernel)")
        left.axhline(sweep["launch_cost_us"], color="gray", ls="--", label=f"launch cost {sweep['launch_cost_us']:.1f} us")
    if sweep.get("crossover_bytes"):
        left.axvline(sweep["crossover_bytes"] / 2**20, color="red", ls=":", label=f"crossover ~{sweep['crossover_side']:.0f}^2 fp32")
    left.set_xlabel("MiB moved per kernel (read + write)")
    left.set_ylabel("us per kernel")
    left.set_title("fp32 add_ on a square tensor: when does launch cost stop mattering?")
    left.legend()
    left.grid(True, which="both", alpha=0.3)

    launch = result["launch"]
    bars = {"CPU issue\nper launch": launch["cpu_issue_us_per_launch"], "eager\nper kernel": launch["eager_us_per_kernel"]}
    if "graph_us_per_kernel" in launch:
        bars = {"graph replay\nper kernel": launch["graph_us_per_kernel"], **bars, "sync after\neach launch": launch["synced_us_per_kernel"]}
    for name, us in result.get("sync", {}).get("idle_device_us", {}).items():
        bars[name.replace(" (", "\n(")] = us
    right.bar(range(len(bars)), list(bars.values()), color=["tab:green"] + ["tab:blue"] * (len(bars) - 1))
    right.set_xticks(range(len(bars)), list(bars), rotation=45, ha="right", fontsize=8)
    right.set_yscale("log")
    right.set_ylabel("us")
    right.set_title("cost of one launch / one host sync")
    right.grid(True, axis="y", which="both", alpha=0.3)
    fig.suptitle(f"fuselab probe: {meta['name']}, torch {meta['torch']}, {meta['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
