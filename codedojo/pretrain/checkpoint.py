"""Checkpoints that resume exactly.

A checkpoint directory holds

    model.safetensors   the model's state dict (our names; MoE selection biases included)
    model_config.json   the ModelConfig (RoPE scaling after a context extension included)
    mtp.safetensors     MTP modules, when the run has them (+ mtp.json)
    trainer.pt          optimizer state and RNG states (torch, numpy, python)
    state.json          stage index, step within the stage, data loader position

It is written into a temporary sibling and renamed, so a crash mid-write never leaves a
checkpoint that looks complete. HF-compatible export goes through the model package's exporter.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from codedojo.model.config import ModelConfig
from codedojo.model.mtp import MTP, save_mtp
from codedojo.pretrain.parallel import distributed, is_main, unwrap_state_dict


@dataclass
class TrainPosition:
    stage: int
    step: int
    loader: dict[str, int]
    done: bool = False


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
            "python": random.getstate()}


def set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
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


def save_checkpoint(path: str | Path, model: nn.Module, cfg: ModelConfig, mtp: MTP | None,
                    optimizer: torch.optim.Optimizer | None, pos: TrainPosition,
                    full: dict[str, torch.Tensor] | None = None) -> Path:
    """``full``: the model's `full_state_dict`, when the caller has gathered it already."""
    from safetensors.torch import save_file

    path = Path(path)
    if full is None:
        full = full_state_dict(model)  # a collective under FSDP: every rank takes part
    if distributed():
        # Sharded optimizer state is not gathered: a multi-GPU resume restores weights, data
        # position and RNG, and restarts the optimizer moments (the CPU path is exact).
        optimizer = None
        if not is_main():
            return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        sd = unwrap_state_dict({k: v.detach().cpu().contiguous() for k, v in full.items()})
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "model_config.json").write_text(cfg.model_dump_json(indent=1))
        if mtp is not None:
            save_mtp(mtp, tmp)
        torch.save({"optimizer": None if optimizer is None else optimizer.state_dict(),
                    "rng": rng_state()}, tmp / "trainer.pt")
        (tmp / "state.json").write_text(json.dumps(asdict(pos)))
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def read_position(path: str | Path) -> TrainPosition:
    return TrainPosition(**json.loads((Path(path) / "state.json").read_text()))


def load_weights(path: str | Path, model: nn.Module, mtp: MTP | None = None) -> ModelConfig:
    """Weights (and MTP) into already-built modules; returns the checkpoint's model config."""
    from safetensors.torch import load_file

    path = Path(path)
    # under FSDP rank 0 alone reads the weights, and sends them (`load_full_state_dict`)
    sd = load_file(str(path / "model.safetensors")) if is_main() else {}
    own = model.state_dict()
    if set(own) != set(sd):  # wrapped (activation checkpointing) vs bare names
        wrapped = {k: k for k in own}
        bare_to_wrapped = {unwrap_state_dict({k: torch.empty(0)}).popitem()[0]: k for k in wrapped}
        sd = {bare_to_wrapped.get(k, k): v for k, v in sd.items()}
    load_full_state_dict(model, sd)
    if mtp is not None:
        # A checkpoint from before the draft vocabulary was chosen (an earlier stage, or a
        # config that gained `mtp_draft_vocab`) lacks it: the MTP stage chooses it then.
        res = mtp.load_state_dict(load_file(str(path / "mtp.safetensors")), strict=False)
        if res.unexpected_keys or set(res.missing_keys) - {"draft_vocab"}:
            raise RuntimeError(f"{path}: MTP weights do not match the configured modules "
                               f"(missing {res.missing_keys}, unexpected {res.unexpected_keys})")
    return ModelConfig.model_validate_json((path / "model_config.json").read_text())


def load_trainer_state(path: str | Path, optimizer: torch.optim.Optimizer | None) -> None:
    state = torch.load(Path(path) / "trainer.pt", weights_only=False)
    if optimizer is not None and state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])
