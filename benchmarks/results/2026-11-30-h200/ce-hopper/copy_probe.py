"""How fast the Hopper kernel's data movement alone copies the logits (README sections 7-8): a program an SM
walking the rows in chunks, brought by TMA through a ring of shared-memory slots (one load warp) and written
back by the compute warps (plain stores, or TMA stores from the slot); the same with Ampere-style cp.async
and no warp specialization; loads straight into registers, from one program an SM up to one chunk a program;
programs that stay on their SMs but take the next chunks from a counter in global memory. Each result is
checked against the input, then timed beside torch's clone.

    PYTHONPATH=. python3 benchmarks/results/2026-11-30-h200/ce-hopper/copy_probe.py [ROWS ...]

CONFIGS, CP_CONFIGS, DIRECT_CONFIGS and COUNTER_CONFIGS hold the last run's settings (copy_probe-6.txt);
the earlier outputs list theirs in each line."""
import sys
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from fuselab.timing import bench


@gluon.jit
def _loads(desc, ring, ready, free, pid, programs, my_rows, n_chunks, segs_per_row, R: gl.constexpr, STAGES: gl.constexpr,
           ORDER: gl.constexpr):
    k = 0
    for j in range(my_rows):
        if ORDER == 0:
            row = pid + (j // n_chunks) * programs
            c = j % n_chunks
        else:
            g = pid + j * programs
            row = g // n_chunks
            c = g % n_chunks
        s = k % STAGES
        mbarrier.wait(free.index(s), ((k // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [row * segs_per_row + c * R, 0], ready.index(s), ring.index(s))
        k += 1


@gluon.jit
def _stores(ring, ready, free, out_ptr, out_desc, n_vocab, pid, programs, my_rows, n_chunks, segs_per_row,
            STAGES: gl.constexpr, CHUNK: gl.constexpr, ORDER: gl.constexpr, TMA_STORE: gl.constexpr, num_warps: gl.constexpr):
    R: gl.constexpr = CHUNK // 256
    LAG: gl.constexpr = STAGES // 2
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [num_warps, 1], [1, 0])
    offs = gl.arange(0, CHUNK // 8, layout=gl.SliceLayout(1, layout))[:, None] * 8 + \
        gl.arange(0, 8, layout=gl.SliceLayout(0, layout))[None, :]
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    k = 0
    for j in range(my_rows):
        if ORDER == 0:
            row = (pid + (j // n_chunks) * programs).to(gl.int64)
            c = j % n_chunks
        else:
            g = pid + j * programs
            row = (g // n_chunks).to(gl.int64)
            c = g % n_chunks
        s = k % STAGES
        mbarrier.wait(ready.index(s), (k // STAGES) & 1)
        if TMA_STORE:
            # The slot goes back once the bulk store has read it, LAG stores later.
            tma.async_copy_shared_to_global(out_desc, [row.to(gl.int32) * segs_per_row + c * R, 0], ring.index(s))
            tma.store_wait(LAG)
            mbarrier.arrive(free.index((k + STAGES - LAG) % STAGES), count=1, pred=k >= LAG)
        else:
            x = ring.index(s)._reinterpret(ring.dtype, [CHUNK // 8, 8], flat).load(layout)
            gl.thread_barrier()
            mbarrier.arrive(free.index(s), count=1)
            cols = c * CHUNK + offs
            gl.store(out_ptr + row * n_vocab + cols, x, mask=cols < n_vocab)
        k += 1
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def _copy_kernel(desc, out_desc, out_ptr, n_rows, n_vocab, SEG: gl.constexpr, STAGES: gl.constexpr, CHUNK: gl.constexpr,
                 ORDER: gl.constexpr, TMA_STORE: gl.constexpr, num_warps: gl.constexpr):
    R: gl.constexpr = CHUNK // SEG
    ring = gl.allocate_shared_memory(desc.dtype, [STAGES, R, SEG], desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=1)
    fence_async_shared()
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    n_chunks = gl.cdiv(n_vocab, CHUNK)
    # Chunks this program copies (named my_rows for the partitions' signatures).
    if ORDER == 0:
        my_rows = gl.cdiv(gl.maximum(n_rows - pid, 0), programs) * n_chunks
    else:
        my_rows = gl.cdiv(gl.maximum(n_rows * n_chunks - pid, 0), programs)
    gl.warp_specialize([
        (_stores, (ring, ready, free, out_ptr, out_desc, n_vocab, pid, programs, my_rows, n_chunks, n_vocab // SEG,
                   STAGES, CHUNK, ORDER, TMA_STORE, num_warps)),
        (_loads, (desc, ring, ready, free, pid, programs, my_rows, n_chunks, n_vocab // SEG, R, STAGES, ORDER)),
    ], [1], [24])


def copy(x, stages, chunk=8192, order=0, ctas_per_sm=1, tma_store=False, warps=8):
    n_rows, n_vocab = x.shape
    out = torch.empty_like(x)
    flat = x.view(-1, 256)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    desc = TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [chunk // 256, 256], layout)
    oflat = out.view(-1, 256)
    out_desc = TensorDescriptor(oflat, list(oflat.shape), list(oflat.stride()), [chunk // 256, 256], layout)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    _copy_kernel[(min(n_rows, ctas_per_sm * sms),)](desc, out_desc, out, n_rows, n_vocab, SEG=256, STAGES=stages, CHUNK=chunk,
                                                    ORDER=order, TMA_STORE=tma_store, num_warps=warps)
    return out


# slots, logits a chunk, order (0: a program walks whole rows, 1: chunk g goes to program g % programs), CTAs an SM
# (then: gradient-like writes by TMA stores from the slot instead of plain stores, compute warps)
CONFIGS = [(8, 8192, 0, 1)]


def main():
    for rows in [int(a) for a in sys.argv[1:]] or [8192]:
        x = torch.randn(rows, 128256, device="cuda", dtype=torch.bfloat16)
        nbytes = 2 * x.numel() * x.element_size()
        line = lambda name, us: print(f"rows {rows} {name:40s} {us:8.1f} us {nbytes / us / 1e3:6.0f} GB/s", flush=True)
        line("clone", bench(lambda: x.clone(), host_ahead=True).median_us)
        for cfg in CONFIGS:
            y = copy(x, *cfg)
            assert torch.equal(y, x), cfg
            line(f"slots, chunk, order, CTAs an SM {cfg}", bench(lambda: copy(x, *cfg), host_ahead=True).median_us)
        for cfg in CP_CONFIGS:
            y = copy_cp_async(x, *cfg)
            assert torch.equal(y, x), cfg
            line(f"cp.async: slots, chunk, CTAs an SM {cfg}", bench(lambda: copy_cp_async(x, *cfg), host_ahead=True).median_us)
        for cfg in DIRECT_CONFIGS:
            y = copy_direct(x, *cfg)
            assert torch.equal(y, x), cfg
            line(f"registers: chunk, in flight, programs an SM {cfg}", bench(lambda: copy_direct(x, *cfg), host_ahead=True).median_us)
        for cfg in COUNTER_CONFIGS:
            y = copy_counter(x, *cfg)
            assert torch.equal(y, x), cfg
            line(f"counter: chunk, in flight, programs an SM {cfg}", bench(lambda: copy_counter(x, *cfg), host_ahead=True).median_us)
        line("zeroing a counter alone", bench(lambda: torch.zeros(1, dtype=torch.int32, device=x.device), host_ahead=True).median_us)
        line("clone again", bench(lambda: x.clone(), host_ahead=True).median_us)


# ---- the same walk with Ampere-style cp.async (16 bytes a thread) instead of TMA, no warp specialization ----
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp_async  # noqa: E402


@gluon.jit
def _issue(x_ptr, smem, j, total, pid, programs, n_chunks, n_vocab, offs, STAGES: gl.constexpr, CHUNK: gl.constexpr):
    row = (pid + (j // n_chunks) * programs).to(gl.int64)
    cols = (j % n_chunks) * CHUNK + offs
    cp_async.async_copy_global_to_shared(smem.index(j % STAGES), x_ptr + row * n_vocab + cols,
                                         mask=(cols < n_vocab) & (j < total))
    cp_async.commit_group()


@gluon.jit
def _cp_async_copy_kernel(x_ptr, out_ptr, n_rows, n_vocab, STAGES: gl.constexpr, CHUNK: gl.constexpr, num_warps: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [num_warps, 1], [1, 0])
    offs = gl.arange(0, CHUNK // 8, layout=gl.SliceLayout(1, layout))[:, None] * 8 + \
        gl.arange(0, 8, layout=gl.SliceLayout(0, layout))[None, :]
    smem = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES, CHUNK // 8, 8], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    n_chunks = gl.cdiv(n_vocab, CHUNK)
    total = gl.cdiv(gl.maximum(n_rows - pid, 0), programs) * n_chunks
    for j in gl.static_range(STAGES - 1):
        _issue(x_ptr, smem, j, total, pid, programs, n_chunks, n_vocab, offs, STAGES, CHUNK)
    for j in range(total):
        _issue(x_ptr, smem, j + STAGES - 1, total, pid, programs, n_chunks, n_vocab, offs, STAGES, CHUNK)
        cp_async.wait_group(STAGES - 1)
        gl.thread_barrier()
        x = smem.index(j % STAGES).load(layout)
        gl.thread_barrier()  # read before the slot's next copy is issued
        row = (pid + (j // n_chunks) * programs).to(gl.int64)
        cols = (j % n_chunks) * CHUNK + offs
        gl.store(out_ptr + row * n_vocab + cols, x, mask=cols < n_vocab)


def copy_cp_async(x, stages, chunk=8192, ctas_per_sm=1):
    n_rows, n_vocab = x.shape
    out = torch.empty_like(x)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    _cp_async_copy_kernel[(min(n_rows, ctas_per_sm * sms),)](x, out, n_rows, n_vocab, STAGES=stages, CHUNK=chunk, num_warps=8)
    return out


CP_CONFIGS = [(8, 8192)]



# ---- no shared memory: loads straight into registers, U chunks in flight a program ----
@gluon.jit
def _direct_copy_kernel(x_ptr, out_ptr, n_rows, n_vocab, CHUNK: gl.constexpr, U: gl.constexpr, num_warps: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [num_warps, 1], [1, 0])
    offs = gl.arange(0, CHUNK // 8, layout=gl.SliceLayout(1, layout))[:, None] * 8 + \
        gl.arange(0, 8, layout=gl.SliceLayout(0, layout))[None, :]
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    n_chunks = gl.cdiv(n_vocab, CHUNK)
    total = gl.cdiv(gl.maximum(n_rows * n_chunks - pid, 0), programs)
    for j0 in range(0, total, U):
        xs = ()
        for u in gl.static_range(U):
            g = pid + (j0 + u) * programs
            row = (g // n_chunks).to(gl.int64)
            cols = (g % n_chunks) * CHUNK + offs
            xs = xs + (gl.load(x_ptr + row * n_vocab + cols, mask=(cols < n_vocab) & (j0 + u < total)),)
        for u in gl.static_range(U):
            g = pid + (j0 + u) * programs
            row = (g // n_chunks).to(gl.int64)
            cols = (g % n_chunks) * CHUNK + offs
            gl.store(out_ptr + row * n_vocab + cols, xs[u], mask=(cols < n_vocab) & (j0 + u < total))


def copy_direct(x, chunk, u, programs_per_sm):
    n_rows, n_vocab = x.shape
    out = torch.empty_like(x)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    _direct_copy_kernel[(programs_per_sm * sms,)](x, out, n_rows, n_vocab, CHUNK=chunk, U=u, num_warps=8)
    return out


DIRECT_CONFIGS = [(8192, 4, 1), (4096, 4, 2), (8192, 1, 1000)]



# ---- programs that stay on an SM but take the next U chunks from a global counter (all SMs move through the
# tensor together, as a grid of short programs does) ----
@gluon.jit
def _counter_copy_kernel(x_ptr, out_ptr, counter_ptr, n_rows, n_vocab, CHUNK: gl.constexpr, U: gl.constexpr,
                         num_warps: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [num_warps, 1], [1, 0])
    offs = gl.arange(0, CHUNK // 8, layout=gl.SliceLayout(1, layout))[:, None] * 8 + \
        gl.arange(0, 8, layout=gl.SliceLayout(0, layout))[None, :]
    n_chunks = gl.cdiv(n_vocab, CHUNK)
    total = n_rows * n_chunks
    g0 = gl.atomic_add(counter_ptr, U)
    while g0 < total:
        xs = ()
        for u in gl.static_range(U):
            g = g0 + u
            row = (g // n_chunks).to(gl.int64)
            cols = (g % n_chunks) * CHUNK + offs
            xs = xs + (gl.load(x_ptr + row * n_vocab + cols, mask=(cols < n_vocab) & (g < total)),)
        g_next = gl.atomic_add(counter_ptr, U)
        for u in gl.static_range(U):
            g = g0 + u
            row = (g // n_chunks).to(gl.int64)
            cols = (g % n_chunks) * CHUNK + offs
            gl.store(out_ptr + row * n_vocab + cols, xs[u], mask=(cols < n_vocab) & (g < total))
        g0 = g_next


def copy_counter(x, chunk, u, programs_per_sm):
    n_rows, n_vocab = x.shape
    out = torch.empty_like(x)
    counter = torch.zeros(1, dtype=torch.int32, device=x.device)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    _counter_copy_kernel[(programs_per_sm * sms,)](x, out, counter, n_rows, n_vocab, CHUNK=chunk, U=u, num_warps=8)
    return out


COUNTER_CONFIGS = [(8192, 4, 1), (8192, 2, 2), (4096, 4, 2), (2048, 4, 4)]


if __name__ == "__main__":
    main()
