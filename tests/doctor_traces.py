"""Synthetic Kineto traces with known answers, in the format torch.profiler exports.

Each scenario is laid out by hand so that every figure the doctor reports (kernels, gaps, syncs,
source lines) can be checked exactly. Times are microseconds from BASE, as in a real trace.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

BASE = 5_000_000_000.0  # Kineto timestamps are large microsecond counts
PID = TID = 4242
STREAM = 7


class TraceBuilder:
    def __init__(self) -> None:
        self.events: list[dict] = [
            {"ph": "M", "name": "process_name", "pid": PID, "tid": 0, "ts": BASE, "args": {"name": "python"}},
            {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "ts": BASE, "args": {"name": "CUDA GPU 0"}},
        ]
        self._external_id = 0
        self._correlation = 0
        self._call_ts: dict[int, float] = {}

    def _x(self, cat: str, name: str, ts: float, dur: float, pid=PID, tid=TID, **args) -> dict:
        event = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": BASE + ts, "dur": dur, "args": args}
        self.events.append(event)
        return event

    def step(self, n: int, ts: float, dur: float) -> None:
        self._external_id += 1
        self._x("user_annotation", f"ProfilerStep#{n}", ts, dur, **{"External id": self._external_id})

    def annotation(self, name: str, ts: float, dur: float) -> None:
        self._external_id += 1
        self._x("user_annotation", name, ts, dur, **{"External id": self._external_id})

    def op(self, name: str, ts: float, dur: float, dims=(), types=()) -> int:
        self._external_id += 1
        self._x("cpu_op", name, ts, dur, **{
            "External id": self._external_id, "Input Dims": list(dims), "Input type": list(types),
            "Sequence number": 0, "Fwd thread id": 0, "Record function id": 0,
        })
        return self._external_id

    def frame(self, name: str, ts: float, dur: float) -> None:
        self._x("python_function", name, ts, dur, **{"Python parent id": None, "Python id": len(self.events)})

    def runtime(self, name: str, ts: float, dur: float, external_id: int | None = None) -> int:
        self._correlation += 1
        self._call_ts[self._correlation] = ts
        self._x("cuda_runtime", name, ts, dur, **{"External id": external_id or 0, "cbid": 211, "correlation": self._correlation})
        return self._correlation

    def gpu(self, name: str, ts: float, dur: float, correlation: int, external_id: int | None, cat: str = "kernel",
            **extra) -> None:
        self._x(cat, name, ts, dur, pid=0, tid=STREAM, **{
            "External id": external_id or 0, "queued": 0, "device": 0, "context": 1, "stream": STREAM,
            "correlation": correlation, "grid": [1, 1, 1], "block": [128, 1, 1], **extra,
        })
        self.events.append({"ph": "s", "id": correlation, "pid": PID, "tid": TID, "ts": BASE + self._call_ts[correlation],
                            "cat": "ac2g", "name": "ac2g"})
        self.events.append({"ph": "f", "id": correlation, "pid": 0, "tid": STREAM, "ts": BASE + ts, "cat": "ac2g", "name": "ac2g", "bp": "e"})

    def launch(self, op_name: str, op_ts: float, kernel_ts: float, kernel_dur: float, dims=(), types=(),
               kernel_name: str | None = None) -> None:
        """An op at op_ts (8 us) whose cudaLaunchKernel runs op_ts+2 .. op_ts+6, its kernel at kernel_ts."""
        ext = self.op(op_name, op_ts, 8.0, dims, types)
        corr = self.runtime("cudaLaunchKernel", op_ts + 2, 4.0, ext)
        self.gpu(kernel_name or f"void at::native::{op_name.removeprefix('aten::')}_kernel<float>(float*)", kernel_ts, kernel_dur, corr, ext)

    def document(self) -> dict:
        return {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H200"}], "record_shapes": 1,
                "with_stack": 1, "traceEvents": self.events, "displayTimeUnit": "ms", "baseTimeNanoseconds": 0}

    def write(self, path: Path) -> Path:
        text = json.dumps(self.document())
        if str(path).endswith(".gz"):
            path.write_bytes(gzip.compress(text.encode()))
        else:
            path.write_text(text)
        return path


RMS_NORM = ("aten::pow", "aten::mean", "aten::add", "aten::rsqrt", "aten::mul", "aten::mul")


def launch_bound(steps: int = 3) -> TraceBuilder:
    """Per 1000 us step: 98 kernels of 2 us, one launched every 10 us (14 x an unfused RMSNorm + a tiny mm).

    Each kernel starts 5 us after its launch call returns, so every gap waits for the host:
    busy 196 us, launch gaps 804 us (7 before the first kernel, 97 x 8 between, 13 after the last).
    """
    b = TraceBuilder()
    cycle = RMS_NORM + ("aten::mm",)
    for n in range(steps):
        s = 2000.0 * n
        b.step(n, s, 1000.0)
        for i in range(98):
            name = cycle[i % len(cycle)]
            dims = [[1, 64], [64, 64]] if name == "aten::mm" else [[1, 64], []]
            b.launch(name, s + 10 * i, s + 10 * i + 7, 2.0, dims, ["float", "float" if name == "aten::mm" else "Scalar"])
    return b


def sync_bound(steps: int = 3) -> TraceBuilder:
    """Per 1000 us step: 10 iterations of a 20 us mm then `.item()` (a 2 us copy to pageable memory + a stream sync).

    Per step: busy 220 us, 10 syncs, launch gap 5 us (before the first mm), sync stalls 775 us
    (1 us before each copy, 77 us after each of the first 9 syncs, 72 us after the last).
    The `.item()` is on line 42 of train.py.
    """
    b = TraceBuilder()
    for n in range(steps):
        s = 2000.0 * n
        b.step(n, s, 1000.0)
        b.frame("train.py(50): <module>", s, 1000.0)
        for j in range(10):
            t = s + 100 * j
            b.frame("train.py(42): loop", t, 95.0)
            ext = b.op("aten::mm", t, 4.0, [[256, 256], [256, 256]], ["c10::BFloat16", "c10::BFloat16"])
            b.gpu("sm90_xmma_gemm_bf16bf16_bf16f32", t + 5, 20.0, b.runtime("cudaLaunchKernel", t + 1, 3.0, ext), ext)
            b.frame("<built-in method item of Tensor object at 0x7f00>", t + 9, 62.0)
            b.op("aten::item", t + 10, 60.0, [[]], ["c10::BFloat16"])
            ext = b.op("aten::_local_scalar_dense", t + 11, 58.0, [[]], ["c10::BFloat16"])
            b.gpu("Memcpy DtoH (Device -> Pageable)", t + 26, 2.0, b.runtime("cudaMemcpyAsync", t + 12, 17.0, ext), ext, cat="gpu_memcpy")
            b.runtime("cudaStreamSynchronize", t + 29, 2.0, ext)
    return b


def memory_bound(steps: int = 3) -> TraceBuilder:
    """Per step: 4 bf16 multiplies of 16M elements (100,663,296 bytes each) in 30 us, queued ahead by the host.

    Per 128 us step: busy 120, launch gap 5 (before the first kernel), other idle 3 (1 us between kernels).
    At the stated 4230 GB/s a multiply could take 23.8 us: 79% of the ceiling.
    """
    b = TraceBuilder()
    n_elem = 16_777_216
    for n in range(steps):
        s = 1000.0 * n
        b.step(n, s, 100.0)
        for k in range(4):
            ext = b.op("aten::mul", s + k, 1.0, [[n_elem], [n_elem]], ["c10::BFloat16", "c10::BFloat16"])
            corr = b.runtime("cudaLaunchKernel", s + k, 1.0, ext)
            b.gpu("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<c10::BFloat16>>()",
                  s + 5 + 31 * k, 30.0, corr, ext)
    return b


def compute_bound(steps: int = 3) -> TraceBuilder:
    """Per step: two 8192^3 bf16 GEMMs (1.0995e12 FLOPs, 1409.6 us at 780 TFLOP/s) of 1800 us each: 78% of the ceiling."""
    b = TraceBuilder()
    for n in range(steps):
        s = 10_000.0 * n
        b.step(n, s, 50.0)
        for k in range(2):
            ext = b.op("aten::mm", s + 2 * k, 1.0, [[8192, 8192], [8192, 8192]], ["c10::BFloat16", "c10::BFloat16"])
            corr = b.runtime("cudaLaunchKernel", s + 2 * k + 1, 1.0, ext)
            b.gpu("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", s + 10 + 1801 * k, 1800.0, corr, ext)
    return b


def cpu_only() -> TraceBuilder:
    b = TraceBuilder()
    b.step(0, 0.0, 100.0)
    b.op("aten::add", 1.0, 5.0, [[4], [4]], ["float", "float"])
    return b


GRAPH_LAYER = ("_rms_norm_forward_kernel", "nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT", "_swiglu_forward_kernel",
               "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK_TNT", "splitKreduce_kernel")


def graph_replay(steps: int = 3, launch_name: str = "cudaGraphLaunch") -> TraceBuilder:
    """Per 600 us step, a step replayed from a CUDA graph as fuselab.graphs.graphed runs it: the input
    copied in (launched alone), one `launch_name` call (100-400 us: the profiler keeps it in progress)
    replaying 4 x GRAPH_LAYER = 20 kernels of 10 us, 5 us apart from 130 us on, and the output copied
    out (launched alone, at 507 us).

    Per step: busy 204 us; launch gaps 301 us (7 before the input copy, 121 waiting for the graph
    launch, 82 before the output copy, 91 after it); other idle 95 us (19 x 5 us inside the replay).
    """
    b = TraceBuilder()
    for n in range(steps):
        s = 1000.0 * n
        b.step(n, s, 600.0)
        b.launch("aten::copy_", s, s + 7, 2.0, [[1, 2048], [1, 2048], []], ["c10::BFloat16", "c10::BFloat16", "Scalar"])
        corr = b.runtime(launch_name, s + 100, 300.0)
        for k in range(20):
            b.gpu(GRAPH_LAYER[k % len(GRAPH_LAYER)], s + 130 + 15 * k, 10.0, corr, None, **{"graph node id": 100 + k})
        b.launch("aten::copy_", s + 500, s + 507, 2.0, [[1, 2048], [1, 2048], []], ["c10::BFloat16", "c10::BFloat16", "Scalar"])
    return b


SIDE = 4096  # of the float32 matrices in host_ahead_fp32_matmul


def host_ahead_fp32_matmul(steps: int = 4, kernel_name: str = "sm90_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x128x8",
                           kernel_us: float = 2700.0, precision: str | None = None) -> TraceBuilder:
    """float32 SIDE^3 matmuls, two a step, recorded as torch.profiler's `prof.step()` records them: no sync at
    step ends, so the host (100 us a step, steps 200 us apart) runs far ahead of the GPU.

    The GPU runs the matmuls back to back (kernel_us each, 1 us apart) from 50 us on. Step 0's window
    starts at its host start: 36 us waiting for the first launch (its call returns at 16, plus the
    20 us allowance), 14 us other idle. Every later step's window starts where the previous step's
    last matmul ended: 1 us before its first matmul and 1 us between its two, both other idle, since
    the launches were made long before. `precision` records the doctor's float32-precision mark.
    """
    b = TraceBuilder()
    if precision is not None:
        b.annotation(f"fuselab.doctor.float32_matmul_precision={precision}", 0.5, 0.0)
    k = 0
    for n in range(steps):
        s = 200.0 * n
        b.step(n, s, 100.0)
        for j in range(2):
            b.launch("aten::mm", s + 10 + 10 * j, 50.0 + (kernel_us + 1) * k, kernel_us,
                     [[SIDE, SIDE], [SIDE, SIDE]], ["float", "float"], kernel_name=kernel_name)
            k += 1
    return b


COPY_BYTES = 256 * 2**20


def host_to_device_copy(steps: int = 3, pinned: bool = False) -> TraceBuilder:
    """Per step (the copy + 200 us): `x.cuda()` of a 256 MiB host tensor, then a 130 us multiply of the copy.

    Pageable (default): the copy runs 40,000 us (6.7 GB/s) at 10 us; its cudaMemcpyAsync call
    (5-40,012 us) lasts the whole copy, then the op waits on the stream (cudaStreamSynchronize,
    40,013-40,015 us): a blocking copy. Pinned: 5,500 us at 10 us (48.8 GB/s), launched with
    non_blocking=True (a 4 us call, no wait).
    """
    b = TraceBuilder()
    copy_us = 5500.0 if pinned else 40_000.0
    route = "Memcpy HtoD (Pinned -> Device)" if pinned else "Memcpy HtoD (Pageable -> Device)"
    for n in range(steps):
        s = 100_000.0 * n
        b.step(n, s, copy_us + 200.0)
        b.op("aten::to", s + 1, copy_us + 20, [[COPY_BYTES // 4], [], [], [], []], ["float", "Scalar", "Scalar", "Scalar", "Scalar"])
        b.op("aten::_to_copy", s + 2, copy_us + 18, [[COPY_BYTES // 4]], ["float"])
        ext = b.op("aten::copy_", s + 3, copy_us + 16, [[COPY_BYTES // 4], [COPY_BYTES // 4]], ["float", "float"])
        call_us = 4.0 if pinned else copy_us + 7
        b.gpu(route, s + 10, copy_us, b.runtime("cudaMemcpyAsync", s + 5, call_us, ext), ext, cat="gpu_memcpy",
              bytes=COPY_BYTES, **{"memory bandwidth (GB/s)": COPY_BYTES / (copy_us * 1e3)})
        if not pinned:
            b.runtime("cudaStreamSynchronize", s + copy_us + 13, 2.0, ext)
        t = s + copy_us + 30
        b.launch("aten::mul", t, t + 7, 130.0, [[COPY_BYTES // 4], []], ["float", "Scalar"])
    return b


ADAMW_UPDATE = ("aten::mul_", "aten::lerp_", "aten::mul_", "aten::addcmul_", "aten::sqrt", "aten::div", "aten::add_", "aten::addcdiv_")


def adamw_loop(steps: int = 3, params: int = 6, annotated: bool = True) -> TraceBuilder:
    """Per 1000 us step: a 100 us GEMM, then AdamW(foreach=False)'s update for `params` parameters:
    ADAMW_UPDATE per parameter, 2 us kernels launched 10 us apart from 200 us on (launch-bound),
    inside the "Optimizer.step#AdamW.step" range torch.optim opens (when `annotated`).
    """
    b = TraceBuilder()
    for n in range(steps):
        s = 2000.0 * n
        b.step(n, s, 1000.0)
        b.launch("aten::mm", s, s + 7, 100.0, [[256, 256], [256, 256]], ["c10::BFloat16"] * 2)
        if annotated:
            b.annotation("Optimizer.step#AdamW.step", s + 195, 10.0 * params * len(ADAMW_UPDATE) + 10)
        for i in range(params * len(ADAMW_UPDATE)):
            name = ADAMW_UPDATE[i % len(ADAMW_UPDATE)]
            b.launch(name, s + 200 + 10 * i, s + 207 + 10 * i, 2.0, [[256, 256], [256, 256]], ["float", "float"])
    return b


def attention(steps: int = 3, layers: int = 4, fused: bool = False) -> TraceBuilder:
    """Per step, `layers` x (a 20 us projection mm, then attention on bf16 (1, 8, 512, 64) heads).

    Hand-written (default): bmm (Q K^T, 15 us) -> div (scale, 6 us) -> _softmax (8 us) -> bmm (P V, 15 us),
    each kernel 2 us after the previous one. Fused: one 25 us _scaled_dot_product_flash_attention kernel.
    """
    b = TraceBuilder()
    q = [1, 8, 512, 64]
    scores = [8, 512, 512]
    for n in range(steps):
        s = 5000.0 * n
        b.step(n, s, 2000.0)
        t = s
        for _ in range(layers):
            b.launch("aten::mm", t, t + 7, 20.0, [[512, 512], [512, 512]], ["c10::BFloat16"] * 2)
            t += 29
            if fused:
                b.launch("aten::_scaled_dot_product_flash_attention", t, t + 7, 25.0, [q, q, q], ["c10::BFloat16"] * 3,
                         kernel_name="void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>(Flash_fwd_params)")
                t += 34
                continue
            for name, dur, dims in (("aten::bmm", 15.0, [scores, [8, 64, 512]]), ("aten::div", 6.0, [scores, []]),
                                    ("aten::_softmax", 8.0, [scores, [], []]), ("aten::bmm", 15.0, [scores, [8, 512, 64]])):
                b.launch(name, t, t + 7, dur, dims, ["c10::BFloat16"] * len(dims),
                         kernel_name="sm90_xmma_gemm_bf16bf16_bf16f32" if name == "aten::bmm" else None)
                t += 7 + dur + 2 - 7
    return b


def sync_bound_with_sites(steps: int = 3, line: int = 47) -> TraceBuilder:
    """sync_bound, recorded by the doctor: each `.item()` followed, as its op returns, by the sync site the doctor
    records (train.py:`line`, in function loop), and at the end of each step one `torch.cuda.synchronize()`
    (no site: its line stays the profiler's)."""
    b = sync_bound(steps)
    for n in range(steps):
        s = 2000.0 * n
        for j in range(10):
            b.annotation(f"fuselab.doctor.sync_site train.py:{line} (loop)", s + 100 * j + 71, 0.0)
        b.runtime("cudaDeviceSynchronize", s + 990.0, 2.0)
    return b
