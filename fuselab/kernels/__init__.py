"""Fused Triton kernels, one file per op (Triton kernel -> host launcher -> autograd.Function).

Torch references for every op live in `fuselab.kernels.reference`.
"""

from fuselab import device as _device  # noqa: F401  (selects compiled or interpreted Triton first)

# --- elementwise, norms, activations, softmax (exports) ---
from fuselab.kernels.add import add
from fuselab.kernels.bias_act import bias_act
from fuselab.kernels.layer_norm import layer_norm
from fuselab.kernels.rms_norm import rms_norm
from fuselab.kernels.softmax import softmax
from fuselab.kernels.swiglu import silu_and_mul, swiglu

# --- rope, cross-entropy (exports) ---

__all__: list[str] = ["add", "bias_act", "layer_norm", "rms_norm", "silu_and_mul", "softmax", "swiglu"]
