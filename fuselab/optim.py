"""FusedAdamW: torch.optim.AdamW whose step is one Triton launch per parameter group and dtype.

Multi-tensor layout. The first step of a group packs, per (device, dtype) bucket, the addresses of
every parameter and of its state into one int64 device table, and cuts every parameter into
fixed-size tiles listed in a second table. The kernel's grid runs over all tiles of all
parameters: a program reads which tensor and offset its tile is, loads the addresses, and
updates BLOCK elements. Later steps only re-send the gradient addresses, and only when they moved
(the caching allocator usually hands back the same blocks), so a step costs the host a pass over
the parameters' addresses and one launch per bucket, with no sync with the device.

State: `exp_avg` and `exp_avg_sq` are float32 whatever the parameter's dtype. A bfloat16 or
float16 parameter also gets a float32 `master` copy, made from the parameter at its first step;
the update runs on the master, and the parameter receives its rounding. Writing into such a
parameter after its first step (say, loading weights) is therefore overwritten by the next step
unless the optimizer is rebuilt. The step count is one host int per group (`group["step"]`),
which also means a parameter without a gradient on some step still advances with its group's
count (torch.optim.AdamW counts per parameter); parameters without a gradient are skipped.
torch's `load_state_dict` casts floating state to each parameter's dtype, so a reloaded bfloat16
parameter's state restarts from bfloat16 precision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fuselab.kernels._common.launch import cdiv
from fuselab.kernels._common.validate import FLOAT_DTYPES, KERNEL_DEVICE_TYPE

# Elements one program updates, and its warps: many small programs keep more loads in flight per SM
# (`scripts/tune-kernels --only adamw` sweeps the choice).
BLOCK = 1024
_NUM_WARPS = 4
# Columns of the per-tensor address table: param, exp_avg, exp_avg_sq, master weights (addresses), numel.
_NUMEL, _COLUMNS = 4, 5


@triton.jit
def _adamw_update(
    param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, master_ptr, offs, numel,
    beta1, beta2, eps, decay_factor, step_size, bias_correction2_sqrt,
    HAS_MASTER: tl.constexpr, MAXIMIZE: tl.constexpr, MASKED: tl.constexpr,
):
    # Only the last tile of a tensor is masked: masks on loaded sizes would stop vectorization.
    if MASKED:
        mask = offs < numel
    else:
        mask = None
    grad = tl.load(grad_ptr + offs, mask=mask).to(tl.float32)
    if MAXIMIZE:
        grad = -grad
    if HAS_MASTER:
        param = tl.load(master_ptr + offs, mask=mask)
    else:
        param = tl.load(param_ptr + offs, mask=mask).to(tl.float32)
    exp_avg = tl.load(exp_avg_ptr + offs, mask=mask)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offs, mask=mask)

    # torch.optim.AdamW's order of operations: decay, moments, bias-corrected step.
    param = param * decay_factor
    exp_avg = exp_avg + (1.0 - beta1) * (grad - exp_avg)
    exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
    denom = tl.div_rn(tl.sqrt_rn(exp_avg_sq), bias_correction2_sqrt) + eps
    param = param - step_size * tl.div_rn(exp_avg, denom)

    tl.store(exp_avg_ptr + offs, exp_avg, mask=mask)
    tl.store(exp_avg_sq_ptr + offs, exp_avg_sq, mask=mask)
    if HAS_MASTER:
        tl.store(master_ptr + offs, param, mask=mask)
    tl.store(param_ptr + offs, param.to(param_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _multi_tensor_adamw_kernel(
    tiles_ptr, addresses_ptr, grad_addresses_ptr, param_dtype_witness,
    beta1, beta2, eps, decay_factor, step_size, bias_correction2_sqrt,
    HAS_MASTER: tl.constexpr, MAXIMIZE: tl.constexpr,
    ALIGNED: tl.constexpr, BLOCK: tl.constexpr, COLUMNS: tl.constexpr,
):
    # param_dtype_witness is any parameter of the bucket: only its pointer type is used, to type
    # the addresses read from the table.
    tile = tl.program_id(0)
    tensor = tl.load(tiles_ptr + 2 * tile)
    # The tile's index within its tensor, times BLOCK: the offset is then known to be a multiple of
    # BLOCK, which the vectorizer needs.
    start = tl.load(tiles_ptr + 2 * tile + 1) * BLOCK
    grad_address = tl.load(grad_addresses_ptr + tensor)
    if grad_address != 0:  # 0: this parameter has no gradient this step
        row = addresses_ptr + tensor * COLUMNS
        param_ptr = tl.load(row + 0).to(param_dtype_witness.dtype)
        exp_avg_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
        exp_avg_sq_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
        master_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
        numel = tl.load(row + 4)
        grad_ptr = grad_address.to(param_dtype_witness.dtype)
        if ALIGNED:
            # Addresses read from memory carry no alignment facts; without these, no vector loads.
            param_ptr = tl.multiple_of(param_ptr, 16)
            grad_ptr = tl.multiple_of(grad_ptr, 16)
            exp_avg_ptr = tl.multiple_of(exp_avg_ptr, 16)
            exp_avg_sq_ptr = tl.multiple_of(exp_avg_sq_ptr, 16)
            master_ptr = tl.multiple_of(master_ptr, 16)
        offs = start + tl.arange(0, BLOCK)
        if start + BLOCK <= numel:
            _adamw_update(
                param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, master_ptr, offs, numel,
                beta1, beta2, eps, decay_factor, step_size, bias_correction2_sqrt,
                HAS_MASTER, MAXIMIZE, False,
            )
        else:
            _adamw_update(
                param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, master_ptr, offs, numel,
                beta1, beta2, eps, decay_factor, step_size, bias_correction2_sqrt,
                HAS_MASTER, MAXIMIZE, True,
            )


@dataclass
class _Bucket:
    """The parameters of one group that share a device and dtype, and their launch tables."""

    params: list[torch.Tensor]
    tiles: torch.Tensor  # [n_tiles, 2] int64: (tensor index, tile index within the tensor)
    addresses: torch.Tensor  # [n_tensors, _COLUMNS] int64
    grad_addresses: torch.Tensor  # [n_tensors] int64, refreshed when gradients move
    grad_address_list: list[int]
    has_master: bool
    aligned: bool


@dataclass
class _GroupPlan:
    param_addresses: list[int]
    buckets: list[_Bucket]


def _address_table(values: list[list[int]] | list[int], device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":
        # Pinned, so the copy is queued on the stream instead of waiting for it.
        return host.pin_memory().to(device, non_blocking=True)
    return host


def _grad_address(p: torch.Tensor, index: int) -> int:
    g = p.grad
    if g is None:
        return 0
    if g.is_sparse:
        raise ValueError(f"FusedAdamW: parameter {index} has a sparse gradient, which AdamW does not support")
    if g.dtype != p.dtype or g.shape != p.shape or not g.is_contiguous():
        raise ValueError(
            f"FusedAdamW: parameter {index}'s gradient must be a contiguous {p.dtype} tensor of shape "
            f"{tuple(p.shape)}, got {g.dtype} {tuple(g.shape)} with strides {g.stride()}"
        )
    return g.data_ptr()


class FusedAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW (decoupled weight decay, no amsgrad) with a multi-tensor Triton step.

    Takes the same `params`, `lr`, `betas`, `eps`, `weight_decay` and `maximize` as
    torch.optim.AdamW; parameters must be contiguous float32, bfloat16 or float16 tensors on the
    device the kernels run on. See the module docstring for how state is kept.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        maximize: bool = False,
    ):
        if not isinstance(lr, (int, float)) or not lr >= 0.0:
            raise ValueError(f"lr must be a non-negative float, got {lr!r}")
        if not eps >= 0.0:
            raise ValueError(f"eps must be non-negative, got {eps!r}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two floats in [0, 1), got {betas!r}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be non-negative, got {weight_decay!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults)
        self._plans: dict[int, _GroupPlan] = {}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._plans.clear()  # the state tensors were replaced: their addresses are stale

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            self._step_group(index, group)
        return loss

    def _step_group(self, index: int, group: dict) -> None:
        params = group["params"]
        param_addresses = [p.data_ptr() for p in params]
        plan = self._plans.get(index)
        if plan is None or plan.param_addresses != param_addresses:
            plan = self._plans[index] = self._build_plan(params, param_addresses)

        grad_lists = []
        for bucket in plan.buckets:
            grads = [_grad_address(p, i) for i, p in enumerate(bucket.params)]
            grad_lists.append(grads)
        if not any(any(grads) for grads in grad_lists):
            return  # nothing to update: the step count does not advance either, as in torch

        step = group.get("step", 0) + 1
        group["step"] = step
        lr, (beta1, beta2) = float(group["lr"]), group["betas"]
        bias_correction1 = 1.0 - beta1**step
        bias_correction2 = 1.0 - beta2**step
        for bucket, grads in zip(plan.buckets, grad_lists):
            if bucket.tiles.shape[0] == 0:
                continue  # only empty parameters
            if grads != bucket.grad_address_list:
                bucket.grad_addresses.copy_(_address_table(grads, bucket.grad_addresses.device), non_blocking=True)
                bucket.grad_address_list = grads
            _multi_tensor_adamw_kernel[(bucket.tiles.shape[0],)](
                bucket.tiles, bucket.addresses, bucket.grad_addresses, bucket.params[0],
                beta1, beta2, group["eps"], 1.0 - lr * group["weight_decay"],
                lr / bias_correction1, math.sqrt(bias_correction2),
                HAS_MASTER=bucket.has_master,
                MAXIMIZE=bool(group["maximize"]), ALIGNED=bucket.aligned, BLOCK=BLOCK, COLUMNS=_COLUMNS,
                num_warps=_NUM_WARPS,
            )

    def _build_plan(self, params: list[torch.Tensor], param_addresses: list[int]) -> _GroupPlan:
        by_key: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for i, p in enumerate(params):
            if p.dtype not in FLOAT_DTYPES:
                raise TypeError(f"FusedAdamW: parameter {i} must be float32, bfloat16 or float16, got {p.dtype}")
            if p.device.type != KERNEL_DEVICE_TYPE:
                raise ValueError(f"FusedAdamW: parameter {i} must be a {KERNEL_DEVICE_TYPE} tensor, got one on {p.device}")
            if not p.is_contiguous():
                raise ValueError(f"FusedAdamW: parameter {i} must be contiguous, got strides {p.stride()}")
            by_key.setdefault((p.device, p.dtype), []).append(p)
        buckets = [self._build_bucket(group_params) for group_params in by_key.values()]
        return _GroupPlan(param_addresses=param_addresses, buckets=buckets)

    def _state_of(self, p: torch.Tensor, needs_master: bool) -> dict:
        """The parameter's float32 state, created zeroed or adopted from a loaded state dict."""
        state = self.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            value = state.get(key)
            state[key] = torch.zeros_like(p, dtype=torch.float32) if value is None else value.to(torch.float32).contiguous()
        if needs_master:
            master = state.get("master")
            state["master"] = p.to(torch.float32) if master is None else master.to(torch.float32).contiguous()
        state.pop("step", None)  # counted per group (group["step"])
        return state

    def _build_bucket(self, params: list[torch.Tensor]) -> _Bucket:
        device = params[0].device
        needs_master = params[0].dtype != torch.float32
        rows, tiles = [], []
        for index, p in enumerate(params):
            state = self._state_of(p, needs_master)
            master_address = state["master"].data_ptr() if needs_master else 0
            rows.append([p.data_ptr(), state["exp_avg"].data_ptr(), state["exp_avg_sq"].data_ptr(), master_address, p.numel()])
            tiles.extend([index, tile] for tile in range(cdiv(p.numel(), BLOCK)))
        aligned = all(address % 16 == 0 for row in rows for address in row[:_NUMEL])
        return _Bucket(
            params=params,
            tiles=_address_table(tiles, device).reshape(-1, 2),
            addresses=_address_table(rows, device),
            grad_addresses=torch.zeros(len(params), dtype=torch.int64, device=device),
            grad_address_list=[0] * len(params),
            has_master=needs_master,
            aligned=aligned,
        )
