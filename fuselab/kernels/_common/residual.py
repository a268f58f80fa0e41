"""The fused residual add that norms share: h = x + residual, formed while the row is loaded."""

import triton
import triton.language as tl


@triton.jit
def load_input_row(X, R, H, offs, mask, HAS_RESIDUAL: tl.constexpr, STORE_SUM: tl.constexpr):
    """x, or h = x + residual, in fp32. h is rounded to the input dtype first, as the unfused add
    leaves it, so the normalized values and the stored h agree; STORE_SUM writes h to H."""
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h = (x + tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)).to(H.dtype.element_ty)
        if STORE_SUM:
            tl.store(H + offs, h, mask=mask)
        x = h.to(tl.float32)
    return x
