"""Parallelism and memory wrappers, applied from outside the model (the model never knows).

* `apply_activation_checkpointing`: every decoder block's activations are recomputed in
  backward; an MoE block recomputes the routing of its forward.
* `apply_compile`: regional `torch.compile`, one compiled graph per block shape, for the calls
  without a KV cache (training, teacher, eval); decoding keeps its own path.
* `apply_fsdp`: FSDP2 (`torch.distributed.fsdp.fully_shard`) per block, then the root; with
  bf16 compute and fp32 reduction when asked. Used when the loop is launched by torchrun with
  more than one process: NCCL on GPUs, gloo on CPUs (tested here with two CPU processes).
  `train_device` says which: the config's `model.device`, each process on its LOCAL_RANK's GPU.
* Data parallelism around it: the MTP modules are small and stay whole on every rank
  (`broadcast_module` once, `average_gradients` every step), MoE expert loads are summed over
  ranks before the bias update (`sum_over_ranks`), the root is gathered by hand where no
  forward gathers it (`gather_root`: MTP steps on stored hidden states), the gradient norm is
  taken over both kinds of parameter (`clip_grad_norm`: torch's refuses the mix), and files
  are written by rank 0 (`main_rank_first`, `is_main`).
"""

from __future__ import annotations

import copy
import functools
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from codedojo.devices import resolve_device
from codedojo.model.moe import MoE
from codedojo.model.transformer import Block


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder block's activations in backward instead of keeping them. Like
    `apply_compile`, it wraps each block's forward in place: the model keeps its modules, its
    parameter names and its decode path (calls with a KV cache, in eval mode or without
    gradients run the block as it is). The recomputation of an MoE block routes as its forward
    did: by the router, or by the indices `router_replay` gave the forward (its context has
    closed by the time of the backward), and leaves the balancing state (expert counts, aux
    loss, last routing) as the forward left it. A `copy.deepcopy` of the wrapped model (a
    reference policy, an EMA) is wrapped the same way around its own weights (`wrap_forward`)."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not all(isinstance(b, Block) for b in layers):
        raise ValueError("activation checkpointing: model has no `layers` ModuleList of blocks")
    for blk in layers:
        if not getattr(blk, "checkpointed", False):
            wrap_forward(blk, _checkpointed)
            blk.checkpointed = True


def wrap_forward(blk: nn.Module, wrap: Callable[[nn.Module], Callable[..., torch.Tensor]]) -> None:
    """``blk.forward = wrap(blk)``, ``wrap`` building the new forward around ``blk.forward`` as
    it is. The wraps are remembered in order, so that `copy.deepcopy` (which looks
    ``__deepcopy__`` up on the instance) gives the copy the same wraps around its own layers,
    instead of closures that would go on running the original's."""
    blk.forward = wrap(blk)
    blk.__dict__.setdefault("_forward_wraps", []).append(wrap)
    blk.__deepcopy__ = functools.partial(_copy_wrapped, blk)


def _copy_wrapped(blk: nn.Module, memo: dict[int, Any]) -> nn.Module:
    d = blk.__dict__
    kept = {k: d.pop(k) for k in ("forward", "__deepcopy__", "_forward_wraps")}
    try:
        twin = copy.deepcopy(blk, memo)
    finally:
        d.update(kept)
    for wrap in kept["_forward_wraps"]:
        wrap_forward(twin, wrap)
    return twin


def _checkpointed(blk: nn.Module) -> Callable[..., torch.Tensor]:
    return _recomputed(blk, blk.forward)


def _recomputed(blk: Block, inner: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    moes = [m for m in blk.modules() if isinstance(m, MoE)]

    def forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, cache: object | None) -> torch.Tensor:
        if cache is not None or not (blk.training and torch.is_grad_enabled()):
            return inner(x, cos, sin, mask, cache)
        if not moes:
            return checkpoint(inner, x, cos, sin, mask, cache, use_reentrant=False)
        # the routing the forward was given (None: its router's choice, which the
        # recomputation repeats: same inputs, and the bias moves only after the optimizer step)
        # (and the tokens its balancing counted: the recomputed balance loss is the same)
        given = [(m.replay_indices, m.counted) for m in moes]
        calls = 0

        def run(*args: object) -> torch.Tensor:
            nonlocal calls
            calls += 1
            if calls == 1:  # the forward
                return inner(*args)
            kept = [(m.replay_indices, m.counted, m.tokens_per_expert.clone(), m.aux_loss,
                     m.last_indices) for m in moes]
            try:
                for m, (idx, counted) in zip(moes, given, strict=True):
                    m.replay_indices, m.counted = idx, counted
                return inner(*args)
            finally:
                for m, (replay, counted, counts, aux, last) in zip(moes, kept, strict=True):
                    m.replay_indices, m.counted, m.aux_loss, m.last_indices = (replay, counted,
                                                                               aux, last)
                    m.tokens_per_expert.copy_(counts)

        return checkpoint(run, x, cos, sin, mask, cache, use_reentrant=False)

    return forward


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
        wrap_forward(blk, _compiled)


def _compiled(blk: nn.Module) -> Callable[..., torch.Tensor]:
    plain = blk.forward
    compiled = torch.compile(plain, dynamic=True)

    def forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, cache: object | None) -> torch.Tensor:
        return (compiled if cache is None else plain)(x, cos, sin, mask, cache)

    return forward


def train_device(requested: str = "auto") -> torch.device:
    """The device this process trains on: ``cpu``, ``cuda`` (this process's GPU: LOCAL_RANK
    under torchrun), or ``auto`` (the GPU when CUDA is available, else the CPU)."""
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"model.device: {requested!r} is not one of auto, cpu, cuda")
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    try:
        return resolve_device(requested, default_index=rank)
    except ValueError as e:
        many = rank and torch.cuda.device_count()  # (a machine with no GPU needs no hint)
        hint = f" for LOCAL_RANK {rank} (more processes per node than GPUs?)" if many else ""
        raise ValueError(f"model.device = {e}{hint}") from None


def model_device(model: nn.Module) -> torch.device:
    """Where the model computes (under FSDP2: where its shards are)."""
    return next(model.parameters()).device


def init_distributed(device: torch.device) -> tuple[int, int]:
    """(rank, world size); under torchrun, initialises the process group for ``device``'s kind
    of tensors (`train_device`): NCCL between GPUs, gloo between CPUs."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return process_rank(), world


def exit_distributed() -> None:
    """The end of a torchrun process whose work is saved: leave the process group with the
    other ranks, then exit without the interpreter's teardown. In that teardown a thread of
    torch's distributed runtime is now and then destroyed while still running ("terminate
    called without an active exception", SIGABRT: about one run in 140 here, after every file
    was written), and torchrun then reports the finished job as failed. Without a process
    group it only returns."""
    if not dist.is_initialized():
        return
    # Every rank done with the group before any leaves it: a gloo rank that tears down while a
    # peer's last collective is still in flight aborts too.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def process_rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def is_main() -> bool:
    """Rank 0, or the only process: the one that writes files and prints."""
    return process_rank() == 0


def is_sharded(t: torch.Tensor) -> bool:
    """An FSDP2 shard (a DTensor), as opposed to a tensor kept whole on every rank."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def barrier() -> None:
    if distributed():
        dist.barrier()


@contextmanager
def main_rank_first() -> Iterator[None]:
    """Rank 0 runs the body first (it builds files on disk), then the other ranks (they find
    them built and read them)."""
    if not is_main():
        barrier()
    yield
    if distributed() and is_main():
        barrier()


def sharded(model: nn.Module) -> None:
    """Put ``model``'s sharded parameters back in place. While FSDP2 has a module gathered its
    parameters are plain tensors it frees again, and the root stays gathered after a forward
    (`apply_fsdp`: an eval, a probe). An optimizer built then would hold those tensors: the
    gradients go to the shards and the embedding and final norm would never move."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def gather_root(model: nn.Module) -> None:
    """Gather the root's own parameters (under `apply_fsdp`: the embedding, final norm and head)
    for a step that uses them without a forward of the model to gather them: the MTP modules
    trained on stored hidden states. They stay gathered, as after a forward, until `sharded` or
    a checkpoint puts the shards back; a gathered root or a model not sharded is left as is."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.unshard()


def broadcast_object(obj: object) -> object:
    """Rank 0's ``obj`` on every rank (any picklable object)."""
    if not distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_object(obj: object) -> list[object]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not distributed():
        return [obj]
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_module(module: nn.Module) -> None:
    """Every rank takes rank 0's parameters and buffers (a module kept whole on each rank)."""
    if distributed():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=0)


def average_gradients(params: Iterable[torch.Tensor]) -> None:
    """Average over ranks, in one all-reduce, the gradients of the parameters FSDP does not
    shard (kept whole on every rank, as the MTP modules are); FSDP averages its own."""
    if not distributed():
        return
    grads = [p.grad for p in params if p.grad is not None and not is_sharded(p)]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)  # a sum: gloo has no average
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> float:
    """`torch.nn.utils.clip_grad_norm_` (returning the norm before clipping), also over a mix
    of FSDP-sharded gradients (DTensors, whose norm is reduced over ranks) and gradients of
    parameters kept whole on every rank (already averaged: the same everywhere)."""
    if not distributed():
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    grads = [p.grad for p in params if p.grad is not None]
    squares = 0.0
    for group in ([g for g in grads if is_sharded(g)], [g for g in grads if not is_sharded(g)]):
        if group:
            norm = torch.nn.utils.get_total_norm(group)
            squares += float(norm.full_tensor() if is_sharded(norm) else norm) ** 2
    total = squares ** 0.5
    coef = max_norm / (total + 1e-6)
    if coef < 1:
        for g in grads:
            g.mul_(coef)
    return total


def sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over ranks, in place."""
    if distributed():
        dist.all_reduce(t)
    return t


def mean_over_ranks(*xs: float) -> list[float]:
    """Each value's mean over ranks, all in one all-reduce."""
    if not distributed():
        return list(xs)
    # NCCL reduces GPU tensors only
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    t = torch.tensor(xs, dtype=torch.float64, device=dev)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def apply_fsdp(model: nn.Module, bf16: bool = True) -> nn.Module:
    """Shard each block, then the root (which holds embeddings, final norm and head), over all
    ranks, on the device the model is on."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # Named, not left to FSDP: its default mesh is on the accelerator whenever the machine
    # has one, also for a model kept on the CPU.
    mesh = init_device_mesh(model_device(model).type, (world_size(),))

    # The CPU decode kernels read a block's weights in place, which sharding frees: passes
    # with a KV cache (the passkey probe, self-generated data) go op by op, through FSDP.
    model.fuse = False
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else torch.float32,
                              reduce_dtype=torch.float32)
    for blk in model.layers:
        fully_shard(blk, mesh=mesh, mp_policy=mp)
    # The root (embedding, final norm, head) is gathered by the step's one call of `hidden`
    # and stays gathered to the end of backward: the loop then uses it directly (the fused
    # loss, the teacher's head, the MTP modules' embedding and head). No other method of the
    # root is registered with FSDP: each registered call is a forward of its own, whose
    # backward would reshard the root while autograd still holds its weights.
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    from torch.distributed.fsdp import register_fsdp_forward_method

    register_fsdp_forward_method(model, "hidden")
    return model
