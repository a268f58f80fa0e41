"""Flash forward with part of the softmax's exp2 on the FMA pipe (a degree-3 polynomial), against main's and cuDNN.

    PYTHONPATH=. python3 benchmarks/results/2026-11-30-h200/flash-forward-experiments/flash_poly.py
"""
import importlib
import pathlib
import sys
import tempfile

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fuselab.timing import bench

import fuselab.kernels.flash_attention  # noqa: F401  (its file is the source the variants copy)

SRC = pathlib.Path(sys.modules["fuselab.kernels.flash_attention"].__file__).read_text()
# The variants are written as modules of their own: Triton reads a kernel's source from its file.
HERE = pathlib.Path(tempfile.mkdtemp())

HELPERS = '''

@triton.jit
def _exp2_poly(x):
    """2^x for x <= 0 without the SFU: round to j, 2^(x - j) by a cubic (rel. error 1.1e-4), j into the exponent."""
    x = tl.maximum(x, -125.0)
    t = x + 12582912.0
    f = x - (t - 12582912.0)
    p = 0.05459283 * f + 0.24221838
    p = p * f + 0.69336869
    p = p * f + 1.0
    bits = p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _exp2_mixed(x, STAGE: tl.constexpr):
    BM: tl.constexpr = x.shape[0]
    BN: tl.constexpr = x.shape[1]
    if STAGE != _FULL or _POLY == 0:
        y = tl.math.exp2(x)
    elif _POLY == 2:
        a, b = tl.split(tl.reshape(x, [BM, BN // 2, 2]))
        y = tl.reshape(tl.join(tl.math.exp2(a), _exp2_poly(b)), [BM, BN])
    else:
        a, b = tl.split(tl.reshape(x, [BM, BN // 2, 2]))
        b4 = tl.permute(tl.reshape(b, [BM, BN // 16, 2, 4]), [0, 1, 3, 2])
        b0, b1 = tl.split(b4)
        b4 = tl.join(tl.math.exp2(b0), _exp2_poly(b1))
        b = tl.reshape(tl.permute(b4, [0, 1, 3, 2]), [BM, BN // 2])
        y = tl.reshape(tl.join(tl.math.exp2(a), b), [BM, BN])
    return y

'''


def variant(poly):
    name = f"_flash_poly{poly}"
    src = SRC.replace("    p = tl.math.exp2(qk)\n    alpha", "    p = _exp2_mixed(qk, STAGE)\n    alpha")
    assert src != SRC
    marker = "@triton.jit\ndef _softmax_step("
    src = src.replace(marker, f"_POLY = tl.constexpr({poly})\n" + HELPERS + marker)
    (HERE / f"{name}.py").write_text(src)
    sys.path.insert(0, str(HERE))
    return importlib.import_module(name)


def main():
    dev = torch.device("cuda")
    mods = {p: variant(p) for p in (0, 2, 4)}
    for batch, heads, seq in ((8, 16, 4096), (2, 16, 16384)):
        for causal in (False, True):
            q, k, v = (torch.randn(batch, heads, seq, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
            flops = 4 * batch * heads * seq * seq * 128 / (2 if causal else 1)
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            line = f"B{batch} H{heads} S{seq} D128 causal={causal}:"
            times = {}
            for poly, mod in mods.items():
                try:
                    out, _ = mod.flash_forward(q, k, v, None, seq, causal, 128 ** -0.5)
                    err = (out.float() - ref.float()).abs().max().item()
                    t = bench(lambda: mod.flash_forward(q, k, v, None, seq, causal, 128 ** -0.5)).median_us
                except Exception as e:  # noqa: BLE001
                    line += f"  poly{poly} failed {type(e).__name__}: {str(e)[:200]}"
                    continue
                times[poly] = t
                line += f"  poly{poly} {t:.0f} us {flops / t / 1e6:.0f} TF/s err {err:.1e}"
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                t = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)).median_us
            line += f"  cudnn {t:.0f} us {flops / t / 1e6:.0f} TF/s"
            for poly, tp in times.items():
                line += f"  ratio{poly} {t / tp:.3f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
