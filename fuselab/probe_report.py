"""How `fuselab probe` shows its result: rich tables in the terminal and a two-panel plot."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def _fmt(value: float, digits: int = 2) -> str:
    return f"{value:,.{digits}f}"


def _figures_table(result: dict) -> Table:
    meta = result["meta"]
    table = Table(title=f"fuselab probe: {meta['name']} (torch {meta['torch']}, triton {meta['triton']})")
    table.add_column("section")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("unit")

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
    for section, figure, value, unit in rows:
        table.add_row(section, figure, _fmt(value), unit)
    if streams:
        table.add_row("streams", "cross-stream ordering with an event", "holds" if streams["event_ordering_correct"] else "BROKEN", "")
    return table


def _sweep_table(result: dict) -> Table:
    sweep = result["size_sweep"]
    table = Table(title=f"size sweep: {sweep['tensor']}")
    for col in ("side", "MiB moved", "launches", "eager us/kernel", "graph us/kernel", "launch share"):
        table.add_column(col, justify="right")
    for r in sweep["rows"]:
        graph = _fmt(r["graph_us_per_kernel"]) if "graph_us_per_kernel" in r else "-"
        share = f"{r['launch_share_pct']:.0f}%" if "launch_share_pct" in r else "-"
        table.add_row(str(r["side"]), _fmt(r["bytes"] / 2**20, 1), str(r["launches"]), _fmt(r["eager_us_per_kernel"]), graph, share)
    return table


def render(result: dict, console: Console | None = None) -> None:
    console = console or Console()
    console.print(_figures_table(result))
    console.print(_sweep_table(result))
    for skipped in result.get("skipped", []):
        console.print(f"[yellow]skipped[/] {skipped['section']}: {skipped['reason']}")
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
