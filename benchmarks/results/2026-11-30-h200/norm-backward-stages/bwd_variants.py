"""Experimental rms_norm / layer_norm backward variants (not part of the package)."""
import triton
import triton.language as tl
from fuselab.kernels._activations import activate_grad


@triton.jit
def rms_bwd_stages(DY, X, W, RSTD, DX, DW_PARTIAL, n_rows, n_cols, rows_per_program,
                   BLOCK: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    first_row = pid.to(tl.int64) * rows_per_program
    for i in tl.range(0, rows_per_program, num_stages=STAGES):
        row = first_row + i
        mask = cols < tl.where(row < n_rows, n_cols, 0)
        offs = row * n_cols + cols
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row, mask=row < n_rows, other=0.0)
        x_hat = x * rstd
        dy_w = dy * w
        dx = (dy_w - x_hat * (tl.sum(dy_w * x_hat, axis=0) / n_cols)) * rstd
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * x_hat
    tl.store(DW_PARTIAL + pid.to(tl.int64) * n_cols + cols, dw, mask=col_mask)


@triton.jit
def rms_bwd_prefetch(DY, X, W, RSTD, DX, DW_PARTIAL, n_rows, n_cols, rows_per_program,
                     BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """The next row's dy and x are loaded (kept in their storage dtype) before this row is reduced."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    first_row = pid.to(tl.int64) * rows_per_program
    mask = cols < tl.where(first_row < n_rows, n_cols, 0)
    offs = first_row * n_cols + cols
    dy = tl.load(DY + offs, mask=mask, other=0.0)
    x = tl.load(X + offs, mask=mask, other=0.0)
    for i in range(0, rows_per_program):
        row = first_row + i
        nxt = row + 1
        next_mask = cols < tl.where((nxt < n_rows) & (i + 1 < rows_per_program), n_cols, 0)
        next_offs = nxt * n_cols + cols
        dy_next = tl.load(DY + next_offs, mask=next_mask, other=0.0)
        x_next = tl.load(X + next_offs, mask=next_mask, other=0.0)
        mask = cols < tl.where(row < n_rows, n_cols, 0)
        offs = row * n_cols + cols
        rstd = tl.load(RSTD + row, mask=row < n_rows, other=0.0)
        dyf = dy.to(tl.float32)
        x_hat = x.to(tl.float32) * rstd
        dy_w = dyf * w
        dx = (dy_w - x_hat * (tl.sum(dy_w * x_hat, axis=0) / n_cols)) * rstd
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dyf * x_hat
        dy = dy_next
        x = x_next
    tl.store(DW_PARTIAL + pid.to(tl.int64) * n_cols + cols, dw, mask=col_mask)


@triton.jit
def rms_bwd_rows2(DY, X, W, RSTD, DX, DW_PARTIAL, n_rows, n_cols, rows_per_program,
                  BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """ROWS rows per iteration as one [ROWS, BLOCK] tile (rows_per_program even)."""
    ROWS: tl.constexpr = 2
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)[None, :]
    sub = tl.arange(0, ROWS)[:, None]
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    first_row = pid.to(tl.int64) * rows_per_program
    for i in range(0, rows_per_program, ROWS):
        row = first_row + i + sub
        mask = cols < tl.where(row < n_rows, n_cols, 0)
        offs = row * n_cols + cols
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row, mask=row < n_rows, other=0.0)
        x_hat = x * rstd
        dy_w = dy * w
        dx = (dy_w - x_hat * (tl.sum(dy_w * x_hat, axis=1)[:, None] / n_cols)) * rstd
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * x_hat
    tl.store(DW_PARTIAL + pid.to(tl.int64) * n_cols + cols, tl.sum(dw, axis=0)[None, :], mask=col_mask)


@triton.jit
def rms_bwd_row(DY, X, W, RSTD, DX, DW_PARTIAL, n_rows, n_cols, rows_per_program,
                BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Forward-style: one program per row, dx only (dweight left out): how fast can dx alone go."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    offs = row * n_cols + cols
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + row)
    x_hat = x * rstd
    dy_w = dy * w
    dx = (dy_w - x_hat * (tl.sum(dy_w * x_hat, axis=0) / n_cols)) * rstd
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def ln_bwd_prefetch(DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL, n_rows, n_cols, rows_per_program,
                    BLOCK: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    first_row = pid.to(tl.int64) * rows_per_program
    mask = cols < tl.where(first_row < n_rows, n_cols, 0)
    offs = first_row * n_cols + cols
    dy = tl.load(DY + offs, mask=mask, other=0.0)
    x = tl.load(X + offs, mask=mask, other=0.0)
    for i in range(0, rows_per_program):
        row = first_row + i
        nxt = row + 1
        next_mask = cols < tl.where((nxt < n_rows) & (i + 1 < rows_per_program), n_cols, 0)
        next_offs = nxt * n_cols + cols
        dy_next = tl.load(DY + next_offs, mask=next_mask, other=0.0)
        x_next = tl.load(X + next_offs, mask=next_mask, other=0.0)
        mask = cols < tl.where(row < n_rows, n_cols, 0)
        offs = row * n_cols + cols
        mean = tl.load(MEAN + row, mask=row < n_rows, other=0.0)
        rstd = tl.load(RSTD + row, mask=row < n_rows, other=0.0)
        x_hat = tl.where(mask, (x.to(tl.float32) - mean) * rstd, 0.0)
        dz = dy.to(tl.float32)
        dz_w = dz * w
        mean_dz_w = tl.sum(dz_w, axis=0) / n_cols
        mean_dz_w_x_hat = tl.sum(dz_w * x_hat, axis=0) / n_cols
        dx = (dz_w - mean_dz_w - x_hat * mean_dz_w_x_hat) * rstd
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dz * x_hat
        db += dz
        dy = dy_next
        x = x_next
    partial_offs = pid.to(tl.int64) * n_cols + cols
    tl.store(DW_PARTIAL + partial_offs, dw, mask=col_mask)
    tl.store(DB_PARTIAL + partial_offs, db, mask=col_mask)


@triton.jit
def rms_fwd_persistent(X, W, Y, n_rows, n_cols, eps, rows_per_program, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    first_row = pid.to(tl.int64) * rows_per_program
    for i in tl.range(0, rows_per_program, num_stages=STAGES):
        row = first_row + i
        mask = cols < tl.where(row < n_rows, n_cols, 0)
        offs = row * n_cols + cols
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        tl.store(Y + offs, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def bias_act_bwd_stages(DY, X, BIAS, DX, DBIAS_PARTIAL, n_rows, n_cols, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr,
                        ROWS: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(n_cols, BLOCK)
    band = pid // col_blocks
    cols = (pid % col_blocks) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < n_cols
    bias = tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)
    dbias = tl.zeros([BLOCK], dtype=tl.float32)
    first = band.to(tl.int64) * ROWS
    for i in tl.range(ROWS, num_stages=STAGES):
        mask = cols < tl.where(first + i < n_rows, n_cols, 0)
        offs = (first + i) * n_cols + cols
        z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32) + bias
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        dx = dy * activate_grad(z, ACTIVATION)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        dbias += tl.where(mask, dx, 0.0)
    tl.store(DBIAS_PARTIAL + band.to(tl.int64) * n_cols + cols, dbias, mask=col_ok)
