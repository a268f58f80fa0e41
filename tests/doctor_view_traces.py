"""Synthetic Kineto traces for the doctor's tables: top kernels, time by region, streams.

Laid out by hand like tests/doctor_traces.py, so every figure of a table can be checked exactly.
"""

from __future__ import annotations

from doctor_traces import PID, STREAM, TID, TraceBuilder

BACKWARD_TID = 4343  # autograd runs backward on a thread of its own on CUDA
BACKWARD = "autograd::engine::evaluate_function: "  # the op the autograd engine records around each backward node
COPY_STREAM, NCCL_STREAM = 9, 11
SMS = 132


class ViewTraceBuilder(TraceBuilder):
    """A TraceBuilder that places ops and launches on any host thread and kernels on any stream."""

    def __init__(self, sms: int | None = SMS) -> None:
        super().__init__()
        self.sms = sms

    def op_on(self, name: str, ts: float, dur: float, tid: int = TID, sequence: int | None = None,
              dims=(), types=()) -> int:
        self._external_id += 1
        args = {"External id": self._external_id, "Input Dims": list(dims), "Input type": list(types)}
        if sequence is not None:
            args["Sequence number"] = sequence
        self._x("cpu_op", name, ts, dur, tid=tid, **args)
        return self._external_id

    def module(self, name: str, ts: float, dur: float, tid: int = TID) -> None:
        self._x("python_function", f"nn.Module: {name}", ts, dur, tid=tid, **{"Python id": len(self.events)})

    def kernel_on(self, name: str, call_ts: float, ts: float, dur: float, external_id: int | None, tid: int = TID,
                  stream: int = STREAM, grid=(1, 1, 1), cat: str = "kernel", call: str = "cudaLaunchKernel") -> None:
        """A launch call on host thread `tid` at call_ts (2 us), and what it launched on `stream` at ts."""
        self._correlation += 1
        corr = self._correlation
        self._x("cuda_runtime", call, call_ts, 2.0, tid=tid, **{"External id": external_id or 0, "correlation": corr})
        self._x(cat, name, ts, dur, pid=0, tid=stream, **{
            "External id": external_id or 0, "device": 0, "stream": stream, "correlation": corr,
            "grid": list(grid), "block": [128, 1, 1],
        })
        self.events.append({"ph": "s", "id": corr, "pid": PID, "tid": tid, "ts": self.events[-2]["ts"], "cat": "ac2g",
                            "name": "ac2g"})
        self.events.append({"ph": "f", "id": corr, "pid": 0, "tid": stream, "ts": self.events[-2]["ts"], "cat": "ac2g",
                            "name": "ac2g", "bp": "e"})

    def document(self) -> dict:
        doc = super().document()
        if self.sms is not None:
            doc["deviceProperties"] = [{"id": 0, "name": "NVIDIA H200", "numSms": self.sms}]
        return doc


BF16 = ["c10::BFloat16", "c10::BFloat16"]
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64"
GEMV = "void gemv2T_kernel_val<int, int, __nv_bfloat16, float, 128, 16, 4, 4, false>(float)"
TRITON = "triton_poi_fused_add_0"


def kernel_mix(steps: int = 2, sms: int | None = SMS) -> ViewTraceBuilder:
    """Per 2000 us step: 2 x a 4096^3 bf16 GEMM of 250 us (1.374e11 FLOPs: 549.8 TFLOP/s, 70.5% of 780) on a
    32x32 grid; 4 x a batch-1 GEMV (aten::mm of [1, 4096] x [4096, 4096]: 33,570,816 bytes) of 10 us
    (3357 GB/s, 79.4% of 4230) on 8 blocks; 1 x a Triton kernel with no op of 5 us on 64 blocks."""
    b = ViewTraceBuilder(sms)
    for n in range(steps):
        s = 10_000.0 * n
        b.step(n, s, 2000.0)
        for k in range(2):
            ext = b.op_on("aten::mm", s + 10 * k, 5.0, dims=[[4096, 4096], [4096, 4096]], types=BF16)
            b.kernel_on(GEMM, s + 10 * k + 1, s + 100 + 300 * k, 250.0, ext, grid=(32, 32, 1))
        for k in range(4):
            ext = b.op_on("aten::mm", s + 50 + 10 * k, 5.0, dims=[[1, 4096], [4096, 4096]], types=BF16)
            b.kernel_on(GEMV, s + 51 + 10 * k, s + 800 + 20 * k, 10.0, ext, grid=(8, 1, 1))
        b.kernel_on(TRITON, s + 100, s + 1000, 5.0, None, grid=(64, 1, 1))
    return b


def training_step(steps: int = 2) -> ViewTraceBuilder:
    """Per 5000 us step, a training step of Net_0 = Linear_0 -> Linear_1, then a loss outside the modules:

    forward (inside a "forward" range, host 0..1000): Linear_0's GEMM 100 us, Linear_1's 50 us, the loss's sum 10 us;
    backward (thread BACKWARD_TID, autograd engine ops linked to the forward ops by sequence number):
    Linear_1's 100 us, Linear_0's 2 x 200 us, AccumulateGrad's 20 us (no module);
    optimizer (inside "Optimizer.step#AdamW.step", host 2000..2500): one fused AdamW kernel of 150 us.
    GPU per step: forward 160, backward 520, optimizer 150; 830 in all.
    """
    b = ViewTraceBuilder()
    for n in range(steps):
        s = 10_000.0 * n
        seq_0, seq_1 = 2 * n, 2 * n + 1  # autograd numbers ops in the order they ran, across steps
        b.step(n, s, 5000.0)
        b.annotation("forward", s, 1000.0)
        b.module("Net_0", s + 10, 890.0)
        b.module("Linear_0", s + 20, 380.0)
        ext = b.op_on("aten::linear", s + 30, 50.0, sequence=seq_0, dims=[[64, 1024], [4096, 1024]], types=BF16)
        b.kernel_on(GEMM, s + 40, s + 100, 100.0, ext, grid=(32, 8, 1))
        b.module("Linear_1", s + 500, 300.0)
        ext = b.op_on("aten::linear", s + 510, 50.0, sequence=seq_1, dims=[[64, 4096], [1024, 4096]], types=BF16)
        b.kernel_on(GEMM, s + 520, s + 600, 50.0, ext, grid=(8, 8, 1))
        ext = b.op_on("aten::sum", s + 950, 20.0, dims=[[64, 1024]], types=["c10::BFloat16"])
        b.kernel_on("reduce_kernel", s + 955, s + 960, 10.0, ext)

        ext = b.op_on(f"{BACKWARD}AddmmBackward0", s + 1100, 100.0, BACKWARD_TID, sequence=seq_1)
        b.kernel_on(GEMM, s + 1110, s + 1150, 100.0, ext, tid=BACKWARD_TID)
        ext = b.op_on(f"{BACKWARD}AddmmBackward0", s + 1300, 100.0, BACKWARD_TID, sequence=seq_0)
        b.kernel_on(GEMM, s + 1310, s + 1350, 200.0, ext, tid=BACKWARD_TID)
        b.kernel_on(GEMM, s + 1320, s + 1560, 200.0, ext, tid=BACKWARD_TID)
        ext = b.op_on(f"{BACKWARD}torch::autograd::AccumulateGrad", s + 1800, 50.0, BACKWARD_TID)
        b.kernel_on("vectorized_elementwise_kernel", s + 1810, s + 1820, 20.0, ext, tid=BACKWARD_TID)

        b.annotation("Optimizer.step#AdamW.step", s + 2000, 500.0)
        ext = b.op_on("aten::_fused_adamw_", s + 2010, 50.0)
        b.kernel_on("fused_adamw_kernel", s + 2020, s + 2050, 150.0, ext)
    return b


NCCL_ALL_REDUCE = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def overlapped_streams(steps: int = 2) -> ViewTraceBuilder:
    """Per 1000 us step: compute on stream 7 over 100..400 and 500..700; a host-to-device copy on
    stream 9 over 300..600; an NCCL all-reduce on stream 11 over 650..900.

    Per step: busy 500 / 300 / 250 us on streams 7 / 9 / 11; the copy overlaps compute 200 us
    (300..400 and 500..600), the all-reduce 50 us (650..700)."""
    b = ViewTraceBuilder()
    for n in range(steps):
        s = 1000.0 * n
        b.step(n, s, 1000.0)
        ext = b.op_on("aten::mm", s, 5.0, dims=[[2048, 2048], [2048, 2048]], types=BF16)
        b.kernel_on(GEMM, s + 1, s + 100, 300.0, ext)
        ext = b.op_on("aten::copy_", s + 10, 5.0, dims=[[4096, 4096], [4096, 4096]], types=BF16)
        b.kernel_on("Memcpy HtoD (Pinned -> Device)", s + 11, s + 300, 300.0, ext, stream=COPY_STREAM, cat="gpu_memcpy",
                    call="cudaMemcpyAsync")
        ext = b.op_on("aten::mm", s + 20, 5.0, dims=[[2048, 2048], [2048, 2048]], types=BF16)
        b.kernel_on(GEMM, s + 21, s + 500, 200.0, ext)
        ext = b.op_on("c10d::allreduce_", s + 30, 5.0)
        b.kernel_on(NCCL_ALL_REDUCE, s + 31, s + 650, 250.0, ext, stream=NCCL_STREAM, grid=(2, 1, 1))
    return b
