"""Checkpoints that resume exactly.

A checkpoint directory holds

    model.safetensors   the model's state dict (our names; MoE selection biases included)
    model_config.json   the ModelConfig (RoPE scaling after a context extension included)
    mtp.safetensors     MTP modules, when the run has them (+ mtp.json)
    trainer.pt          optimizer state (whole tensors, keyed by parameter name) and RNG
                        states (torch, numpy, python; one set per rank)
    state.json          stage index, step within the stage, data loader position, and the
                        number of processes that trained it
    tokenizer.json      the run's tokenizer (+ tokenizer_config.json): a checkpoint loads,
                        serves or starts another run on its own

It is written into a temporary sibling and renamed, so a crash mid-write never leaves a
checkpoint that looks complete. HF-compatible export goes through the model package's exporter.

Under FSDP2 the shards are gathered (weights and optimizer moments alike) and rank 0 writes one
checkpoint of whole tensors; a resume has rank 0 read it and send each rank its shards. The
weights do not depend on the number of processes, but a stage's rows and the loader's position
in them do (the ranks share them out): a stage stopped part-way resumes on as many processes as
it was started on (`TrainPosition.world`); a finished stage is taken up by a run on any number.
"""

from __future__ import annotations

import hashlib
import json
import random
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from codedojo.model.config import ModelConfig
from codedojo.model.mtp import MTP, grow_chain, save_mtp
from codedojo.model.weights import checkpoint_config
from codedojo.paths import remove_staged_leftovers, save_tensors, staged_dir
from codedojo.pretrain.parallel import (
    broadcast_object,
    distributed,
    gather_object,
    is_main,
    is_sharded,
    process_rank,
)


@dataclass
class TrainPosition:
    stage: int
    step: int
    loader: dict[str, int]
    done: bool = False
    world: int | None = None  # the processes that trained it (None: not recorded, older)


# What a trainer.pt holds besides tensors and Python's plain values: NumPy's RNG state (an
# array), which `torch.load(weights_only=True)` unpickles only when these are allowed.
NUMPY_RNG_STATE = [np._core.multiarray._reconstruct, np.ndarray, np.dtype,
                   type(np.dtype(np.uint32))]


def rng_state() -> dict[str, Any]:
    """Every generator a step may draw from: torch's (CPU, and this process's GPU once CUDA is
    in use), NumPy's and Python's."""
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
            "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None}


def seed_rngs(seed: int) -> None:
    """Seed every generator `rng_state` keeps, so that two runs save the same states."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["cuda"])
    np.random.set_state(s["numpy"])
    random.setstate(s["python"])


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded weights: under FSDP2 the parameters are DTensors and are gathered first (a
    collective: every rank calls it; rank 0 gets the tensors, the others an empty dict)."""
    if distributed():
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
    return model.state_dict()


def weights_digest(model: nn.Module, cfg: ModelConfig) -> str:
    """A short hash of what the model computes: its config (RoPE scaling included) and its
    state dict (weights and MoE selection biases), the same on every rank (under FSDP2 each
    tensor is gathered in turn, a collective: every rank calls it). It names the weights that
    wrote data derived from them."""
    h = hashlib.blake2b(cfg.model_dump_json().encode(), digest_size=8)
    for name, t in sorted(model.state_dict().items()):
        if is_sharded(t):
            t = t.full_tensor()
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def load_full_state_dict(model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """`model.load_state_dict(sd)` for whole tensors, sharding them where FSDP2 has: there
    rank 0 holds them (the others pass an empty dict) and sends each rank its shards."""
    if distributed():
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        set_model_state_dict(model, sd, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True, strict=True))
    else:
        model.load_state_dict(sd, strict=True)


def _optimizer_names(model: nn.Module, mtp: MTP | None,
                     optimizer: torch.optim.Optimizer) -> tuple[nn.Module, set[str]]:
    """The module the optimizer's parameters are named from (the model under ``model.``, the
    MTP modules under ``mtp.``), and the names there of the trained parameters."""
    modules = nn.ModuleDict({"model": model, **({"mtp": mtp} if mtp is not None else {})})
    trained = {id(p) for g in optimizer.param_groups for p in g["params"]}
    return modules, {name for name, p in modules.named_parameters() if id(p) in trained}


def optimizer_state_dict(model: nn.Module, mtp: MTP | None,
                         optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state with whole tensors, keyed by parameter name. Under FSDP2 a
    collective (the moments of sharded parameters are gathered): every rank calls it, rank 0
    gets the state, the others an empty dict."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    modules, _ = _optimizer_names(model, mtp, optimizer)
    return get_optimizer_state_dict(modules, optimizer, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True)) or {}


def save_checkpoint(path: str | Path, model: nn.Module, cfg: ModelConfig, mtp: MTP | None,
                    optimizer: torch.optim.Optimizer | None, pos: TrainPosition,
                    full: dict[str, torch.Tensor] | None = None,
                    tokenizer: Any | None = None) -> Path:
    """``full``: the model's `full_state_dict`, when the caller has gathered it already. Under
    FSDP2 every rank calls it (the shards are gathered) and rank 0 writes. ``tokenizer``: the
    run's, saved with the weights, so that any checkpoint loads and serves on its own."""

    path = Path(path)
    if full is None:
        full = full_state_dict(model)
    osd = None if optimizer is None else optimizer_state_dict(model, mtp, optimizer)
    rngs = gather_object(rng_state())  # each rank's own: a rank may draw random numbers
    if not is_main():
        return path
    remove_staged_leftovers(path)  # (of a run killed as it saved: a preemption)
    with staged_dir(path, replace=True) as tmp:
        sd = {k: v.detach().cpu().contiguous() for k, v in full.items()}
        save_tensors(sd, tmp / "model.safetensors")
        (tmp / "model_config.json").write_text(cfg.model_dump_json(indent=1))
        if mtp is not None:
            save_mtp(mtp, tmp)
        torch.save({"optimizer": osd, "rng_ranks": rngs}, tmp / "trainer.pt")
        (tmp / "state.json").write_text(json.dumps(asdict(pos)))
        if tokenizer is not None:
            tokenizer.save(tmp)
    return path


def read_position(path: str | Path) -> TrainPosition:
    return TrainPosition(**json.loads((Path(path) / "state.json").read_text()))


def position_of(path: str | Path) -> TrainPosition | None:
    """Where a stage's checkpoint directory stands, or None where it has none."""
    return read_position(path) if (Path(path) / "state.json").exists() else None


def load_weights(path: str | Path, model: nn.Module, mtp: MTP | None = None) -> ModelConfig:
    """Weights (and MTP) into already-built modules; returns the checkpoint's model config."""
    from safetensors.torch import load_file

    path = Path(path)
    # under FSDP rank 0 alone reads the weights, and sends them (`load_full_state_dict`)
    sd = load_file(str(path / "model.safetensors")) if is_main() else {}
    load_full_state_dict(model, sd)
    if mtp is not None:
        # A checkpoint from before the draft vocabulary was chosen (an earlier stage, or a
        # config that gained `mtp_draft_vocab`) lacks it: the MTP stage chooses it then. One of
        # fewer modules (a branch that grows the chain) gives its last to the new ones. One of
        # modules that read no tapped layers (a branch that adds `mtp_taps`) leaves their
        # projections at zero, one of fewer blocks (a branch that raises `mtp_blocks`) the
        # further blocks as the identity: the modules draft as they did.
        sd = grow_chain(load_file(str(path / "mtp.safetensors")), mtp.depth)
        res = mtp.load_state_dict(sd, strict=False)
        fresh = {"draft_vocab"} | {n for n in res.missing_keys
                                   if (part := _added_part(n)) and not any(part in k for k in sd)}
        if res.unexpected_keys or set(res.missing_keys) - fresh:
            raise RuntimeError(f"{path}: MTP weights do not match the configured modules "
                               f"(missing {res.missing_keys}, unexpected {res.unexpected_keys})")
    return checkpoint_config(path)


def _added_part(name: str) -> str | None:
    """The part of the MTP modules that a branch may add and that weight ``name`` belongs to
    (``.fuse.``, or ``.extra_blocks.J.``), or None. A checkpoint with none of a part leaves
    it as the modules start it: a projection at zero, a block as the identity."""
    if ".fuse." in name:
        return ".fuse."
    if ".extra_blocks." in name:  # layers.K.extra_blocks.J....
        return f".extra_blocks.{name.split('.')[3]}."
    return None


def load_trainer_state(path: str | Path, model: nn.Module, mtp: MTP | None,
                       optimizer: torch.optim.Optimizer | None) -> None:
    """The optimizer state and this rank's RNG states. Under FSDP2 every rank calls it: rank 0
    reads the file and sends each rank its shards of the moments and its RNG states."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    path = Path(path)
    state = None
    if is_main():  # tensors and plain values only: a trainer.pt from elsewhere runs no code
        with torch.serialization.safe_globals(NUMPY_RNG_STATE):
            state = torch.load(path / "trainer.pt", weights_only=True)
    osd: dict[str, Any] = {}
    if optimizer is not None:
        modules, names = _optimizer_names(model, mtp, optimizer)
        kind = None
        if is_main():
            osd = state["optimizer"] or {}
            kind = _optimizer_state_kind(osd, names)
        kind = broadcast_object(kind)  # every rank takes the same branch (they are collectives)
        if kind == "positional" and not distributed():  # written by an older version
            optimizer.load_state_dict(osd)
        elif kind == "named":
            set_optimizer_state_dict(modules, optimizer, osd,
                                     options=StateDictOptions(
                                         full_state_dict=True, broadcast_from_rank0=distributed()))
        elif kind == "none":
            warnings.warn(f"{path}: the checkpoint has no optimizer state (written by a sharded "
                          "run of an older version); the optimizer moments start at zero",
                          stacklevel=2)
        else:
            raise ValueError(f"{path / 'trainer.pt'}: {kind}")
    # (an older version saved one set, as "rng")
    rngs = broadcast_object(None if state is None else state.get("rng_ranks", [state.get("rng")]))
    rank = process_rank()
    # read by more processes than wrote it (a checkpoint from before `TrainPosition.world`,
    # or one read outside a run): the ranks it did not have take rank 0's
    set_rng_state(rngs[rank] if rank < len(rngs) else rngs[0])


def _optimizer_state_kind(osd: dict[str, Any], names: set[str]) -> str:
    """"named", "positional" (an older version's), "none", or why the saved optimizer state
    does not fit an optimizer over the parameters ``names``."""
    if not osd:
        return "none"
    saved = [n for g in osd["param_groups"] for n in g["params"]]
    if all(isinstance(n, int) for n in saved):
        if distributed():
            return "an older version's optimizer state cannot be loaded by a sharded run"
        return "positional"
    missing, unexpected = names - set(saved), set(saved) - names
    if missing or unexpected:
        return (f"the optimizer state does not match the trained parameters (missing "
                f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})")
    return "named"
