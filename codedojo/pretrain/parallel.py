"""Parallelism and memory wrappers, applied from outside the model (the model never knows).

* `apply_activation_checkpointing`: wraps every decoder block so its activations are recomputed
  in backward.
* `apply_compile`: regional `torch.compile`, one compiled graph per block shape, for the calls
  without a KV cache (training, teacher, eval); decoding keeps its own path.
* `apply_fsdp`: FSDP2 (`torch.distributed.fsdp.fully_shard`) per block, then the root; with
  bf16 compute and fp32 reduction when asked. Used when the loop is launched by torchrun with
  more than one process; it cannot run on this single-CPU machine, so it is kept minimal and
  follows the documented FSDP2 recipe (per-block sharding, root last).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from codedojo.model.transformer import Block


class CheckpointedBlock(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args: object) -> torch.Tensor:
        if not self.training:
            return self.block(*args)
        return checkpoint(self.block, *args, use_reentrant=False)


def apply_activation_checkpointing(model: nn.Module) -> None:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError("activation checkpointing: model has no `layers` ModuleList")
    for i, blk in enumerate(layers):
        if not isinstance(blk, CheckpointedBlock):
            layers[i] = CheckpointedBlock(blk)


def apply_compile(*parts: nn.Module | None) -> None:
    """Compile the forward of each decoder block in ``parts`` (the model, its MTP modules) for
    the calls without a KV cache. Inductor fuses the
    elementwise work between the matrix multiplies (RMSNorm, rotary, SwiGLU, residual adds, and
    their backward) into a few loops: on CPU these are about a quarter of an eager training step.
    The blocks share one code object, so all layers share the compiled graphs. Calls with a
    cache (decoding, prefill) stay eager: there the fused decode kernels or small ops run.
    Parameters and state-dict names are untouched.

    Sizes are symbolic from the start (stages change batch and length; measured as fast as
    static sizes in `benchmarks/train_throughput.py`). A graph still exists per grad mode,
    frozen or trained parameters and masked or causal attention: up to eight, the default
    recompile limit, so it is raised to leave room for MoE variants."""
    import torch._dynamo.config

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    for blk in (m for part in parts if part is not None for m in part.modules()
                if isinstance(m, Block)):
        plain = blk.forward
        compiled = torch.compile(plain, dynamic=True)

        def forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    mask: torch.Tensor | None, cache: object | None,
                    plain: Callable[..., torch.Tensor] = plain,
                    compiled: Callable[..., torch.Tensor] = compiled) -> torch.Tensor:
            return (compiled if cache is None else plain)(x, cos, sin, mask, cache)

        blk.forward = forward


def unwrap_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Names as the bare model has them (checkpoint wrappers add `.block`)."""
    return {k.replace(".block.", ".", 1) if k.startswith("layers.") and ".block." in k else k: v
            for k, v in sd.items()}


def init_distributed() -> tuple[int, int]:
    """(rank, world size); initialises the process group under torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank, world


def apply_fsdp(model: nn.Module, bf16: bool = True) -> nn.Module:
    """Shard each block, then the root (which holds embeddings, final norm and head)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else torch.float32,
                              reduce_dtype=torch.float32)
    for blk in model.layers:
        fully_shard(blk, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    # The loop calls these besides forward (the fused loss and the MTP distillation); FSDP2
    # gathers the root's parameters for them too. The root keeps its parameters unsharded
    # after a forward, so the final norm and output projection stay usable until backward.
    from torch.distributed.fsdp import register_fsdp_forward_method

    for name in ("hidden", "head"):
        register_fsdp_forward_method(model, name)
    return model
