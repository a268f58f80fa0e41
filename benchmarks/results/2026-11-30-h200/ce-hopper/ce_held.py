"""The merged Hopper kernel with its settings as arguments: chunks kept in shared memory, streamed chunks
held in registers for the gradient, compute warps."""
import importlib

import torch

hopper = importlib.import_module("fuselab.kernels._cross_entropy_hopper")


def run(x, t, keep, held, warps, stages=13):
    saved = hopper._KEEP, hopper._HELD, hopper._WARPS, hopper._STAGES
    hopper._KEEP, hopper._HELD, hopper._WARPS, hopper._STAGES = keep, held, warps, stages
    row_loss = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    grad = torch.empty_like(x)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    hopper.cross_entropy_hopper(x, t, row_loss, grad, -100, True, sms)
    hopper._KEEP, hopper._HELD, hopper._WARPS, hopper._STAGES = saved
    return row_loss, grad


CONFIGS = [  # keep, held, warps[, stages]
    (8, 5, 8),
    (9, 4, 16),
    (8, 4, 16),
    (7, 6, 8),
    (7, 5, 8),
    (9, 5, 8),
    (8, 5, 8),
]
