"""Does an L2 set-aside for persisting accesses (cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE)) let the
cross-entropy gradient's second walk find its row in L2? The first walk's loads are marked evict_last.

    PYTHONPATH=. python3 exp/ce_persist.py
"""
import ctypes
import importlib

import torch

from fuselab.timing import bench

ce = importlib.import_module("fuselab.kernels.cross_entropy")
cuda = ctypes.CDLL("libcuda.so.1")
CU_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06
CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE = 108


def set_aside(nbytes):
    rc = cuda.cuCtxSetLimit(ctypes.c_int(CU_LIMIT_PERSISTING_L2_CACHE_SIZE), ctypes.c_size_t(nbytes))
    got = ctypes.c_size_t(0)
    cuda.cuCtxGetLimit(ctypes.byref(got), ctypes.c_int(CU_LIMIT_PERSISTING_L2_CACHE_SIZE))
    return rc, got.value


def main():
    torch.zeros(1, device="cuda")
    mx = ctypes.c_int(0)
    cuda.cuDeviceGetAttribute(ctypes.byref(mx), ctypes.c_int(CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE), ctypes.c_int(0))
    print(f"max persisting L2: {mx.value >> 20} MB, L2 {torch.cuda.get_device_properties(0).L2_cache_size >> 20} MB", flush=True)
    for rows in (8192, 1024):
        logits = torch.randn(rows, 128256, device="cuda", dtype=torch.bfloat16)
        target = torch.randint(0, 128256, (rows,), device="cuda")
        mb = 2 * logits.numel() * 2
        for mbytes in (0, 8, 16, 24, 32, mx.value >> 20, 0):
            rc, got = set_aside(mbytes << 20)
            us = bench(lambda: ce._cross_entropy_forward(logits, target, -100, "mean", 0.0, write_grad=True)).median_us
            print(f"rows {rows} set-aside {mbytes:3d} MB (rc {rc}, limit now {got >> 20} MB): {us:8.1f} us "
                  f"({100 * mb / us / 1e3 / 4242:.0f}% of copy)", flush=True)
        del logits


if __name__ == "__main__":
    main()
