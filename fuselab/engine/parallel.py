"""Tensor parallelism: one rank's process group, how the model's weights are split, the all-reduce.

Megatron's split of a Llama layer over N ranks: q/k/v and gate/up are column-parallel (rank r
holds num_heads / N query heads, num_kv_heads / N KV heads, and so its share of the KV cache,
and intermediate_size / N of the MLP), o_proj and down_proj row-parallel (rank r holds the
matching input columns and computes a partial sum). So a layer needs one all-reduce after
attention and one after the MLP, nothing else; on a GPU both are NCCL collectives that the
decode CUDA graphs capture.

The embedding and lm_head are replicated, not split: every rank then computes the same full
logits from the same all-reduced hidden state, and samples the same tokens (the sampler's noise
is hashed from the request's seed, not drawn), so no third collective (a gather of vocabulary
shards) and no broadcast of the tokens is needed per step. The price is one copy of the head
per GPU (1 GB for Llama 3 8B in bf16) and its GEMM read in full by each rank.

A rank is a worker process (fuselab.engine.workers starts them; fuselab.engine.rank runs the
engine in each); this module is what the model and the weights loader need of it.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import torch
import torch.distributed as dist

from fuselab.engine.config import ModelConfig

# Checkpoint (Hugging Face) tensor names of the split projections, and the dim each is split on:
# the output features (rows) of the column-parallel ones, the input features of the row-parallel.
_COLUMN_PARALLEL = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "mlp.gate_proj.",
                    "mlp.up_proj.")
_ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """This process's place among the ranks, in an initialized default process group."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum x over the ranks, in place (capturable in a CUDA graph with NCCL)."""
        dist.all_reduce(x)

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's `value` (a collective: every rank calls it)."""
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


def init_rank(rank: int, size: int, rendezvous_file: str, device: torch.device, timeout_s: float) -> TensorParallel:
    """Join the process group: NCCL on a GPU (rank r on cuda:r, which becomes the current device),
    gloo on the CPU. Every collective fails after timeout_s rather than waiting forever."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # device_id makes NCCL set up its communicator now, not inside the first captured graph.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{rendezvous_file}",
                            rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None)
    return TensorParallel(rank, size)


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The model one rank builds: its share of the heads and of the MLP width (EngineConfig has
    checked that `size` divides them); everything else, head_dim and vocabulary included, whole."""
    return dataclasses.replace(config, num_heads=config.num_heads // size, num_kv_heads=config.num_kv_heads // size,
                               intermediate_size=config.intermediate_size // size)


def split_dim(name: str) -> int | None:
    """The dim along which checkpoint tensor `name` is split over the ranks; None: replicated."""
    if any(part in name for part in _COLUMN_PARALLEL):
        return 0  # weight and bias alike
    if name.endswith(_ROW_PARALLEL):
        return 1
    return None


def full_shape(shard_shape: tuple[int, ...], dim: int, size: int) -> tuple[int, ...]:
    """The checkpoint's shape of a tensor whose rank shard has `shard_shape`."""
    return tuple(n * size if d == dim else n for d, n in enumerate(shard_shape))


def read_shard(view, dim: int, tp: TensorParallel) -> torch.Tensor:
    """Rank tp.rank's slice of a safetensors slice `view` along `dim`: only that part is read."""
    n = view.get_shape()[dim] // tp.size
    index = slice(tp.rank * n, (tp.rank + 1) * n)
    return view[index] if dim == 0 else view[:, index]
