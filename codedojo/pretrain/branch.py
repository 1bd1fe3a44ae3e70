"""Branching a run: a new run directory that starts where another one's finished stages end.

Tuning a late stage (the SFT mix, the MTP distillation) should not mean training the stages
before it again. ``dojo pretrain CONFIG --from runs/a --out-dir runs/b`` fills the new run
directory from ``runs/a``: its data (corpus shards, packed rows, self-generated text and hidden
states: each cache is keyed by the settings that made it, so a changed stage makes its own), the
checkpoints of the leading stages whose settings are the same in both configs, and those
stages' report entries. The loop then finds them done and runs the rest. Files are hard links
(copies across file systems): the loop only ever writes new files beside them, and the report,
which it rewrites, is a copy, so the source run is never changed.

Only a source that ran under the same corpus, model, seed and evaluation settings (how often, and
on how many continuations, it evaluates aside) can be branched from: anything else would change
what every stage computes. How the new stages run may differ (the model's ``dtype``, ``device``,
``compile`` and ``activation_checkpointing``, a stage's ``dtype`` and ``checkpoint_every``): a
run made on a laptop in float32 branches on a GPU in bf16, as a resume on another machine would. And the MTP chain may grow (``model.n_mtp``), its
modules start reading tapped layers (``model.mtp_taps``), or stack more blocks
(``model.mtp_blocks``): the last stage that trains MTP modules runs again (and those after it),
the new modules starting as copies of the last one (`grow_chain`), the new projections at zero,
the new blocks as the identity, on the source's continuations (the tapped layers' states computed
from them, `write_features`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from codedojo.paths import staged_dir
from codedojo.pretrain.checkpoint import position_of
from codedojo.pretrain.config import PretrainConfig

# What a branch may change outside the stages: where it goes, whether it exports, and how the
# model computes (not what it is).
_FREE = {"name", "out_dir", "stages", "export_hf"}
_FREE_MODEL = {"dtype", "device", "compile", "activation_checkpointing"}
# How often a stage is saved and the precision it computes in (as the model's `dtype`), not
# what it computes.
_FREE_STAGE = {"checkpoint_every", "dtype"}


class BranchError(ValueError):
    """A run that cannot be branched from, or a place that cannot be branched into."""


def branch_run(src: str | Path, cfg: PretrainConfig) -> list[str]:
    """Fill ``cfg.run_dir`` (missing or empty) from the run in ``src``; returns the names of
    the stages whose checkpoints it took. A source run records its config as ``config.json``."""
    src, dest = Path(src), cfg.run_dir
    if not (src / "config.json").exists():
        runs = sorted(d for d in src.glob("*/config.json")) if src.is_dir() else []
        hint = f"; runs under it: {', '.join(str(r.parent) for r in runs)}" if runs else ""
        raise BranchError(f"{src}: no config.json there (a run writes the config it ran with "
                          f"beside its report){hint}")
    if dest.exists() and any(dest.iterdir()):
        raise BranchError(f"{dest} is not empty: branch into a new out_dir or name")
    old = PretrainConfig.model_validate_json((src / "config.json").read_text())
    differ = _differing(old, cfg, _FREE_MODEL | {"n_mtp", "mtp_taps", "mtp_blocks"})
    if differ:
        raise BranchError(f"{src}: its {', '.join(differ)} differ from this config's, so none "
                          "of its data or stages would be the same")
    had, has = old.model.n_mtp, cfg.model.n_mtp
    if has != had and not 0 < had < has:
        raise BranchError(f"{src}: model.n_mtp {had} -> {has}: a branch may add MTP modules "
                          "to a run that has some (the new ones start as copies of its last), "
                          "not add the first or remove any")
    taps_had, taps_has = old.model.mtp_taps, cfg.model.mtp_taps
    if taps_has != taps_had and not (had and not taps_had):
        raise BranchError(f"{src}: model.mtp_taps {taps_had} -> {taps_has}: a branch may "
                          "give MTP modules that read no tapped layers some (their "
                          "projections start at zero), not change or remove them")
    blocks_had, blocks_has = old.model.mtp_blocks, cfg.model.mtp_blocks
    if blocks_has != blocks_had and not (had and blocks_has > blocks_had):
        raise BranchError(f"{src}: model.mtp_blocks {blocks_had} -> {blocks_has}: a branch "
                          "may stack more blocks in MTP modules (the new ones start as the "
                          "identity), not remove any")
    stages = cfg.stages
    if has > had or taps_has != taps_had or blocks_has != blocks_had:
        # the new modules, or the modules' new projections or blocks, are trained by the last
        # stage that trains modules
        stages = stages[:max((i for i, s in enumerate(stages) if s.mtp != "off"),
                            default=len(stages))]
    reused = []
    for was, now in zip(old.stages, stages, strict=False):
        if (was.model_dump(exclude=_FREE_STAGE) != now.model_dump(exclude=_FREE_STAGE)
                or not _done(src / "ckpt" / now.name)):
            break
        reused.append(now.name)
    with staged_dir(dest, replace=True) as tmp:
        if (src / "data").is_dir():
            shutil.copytree(src / "data", tmp / "data", copy_function=_link)
        for name in reused:
            shutil.copytree(src / "ckpt" / name, tmp / "ckpt" / name, copy_function=_link)
        if (src / "report.json").exists():
            report = _kept(json.loads((src / "report.json").read_text()), reused)
            (tmp / "report.json").write_text(json.dumps({"name": cfg.name, **report}, indent=1))
    return reused


def check_resume(run_dir: Path, cfg: PretrainConfig) -> None:
    """A run goes on under the settings it was started with: refuse, naming them, a config
    whose data or started stages would differ (its prepared data and checkpoints were made by
    the old ones, and would be taken as this config's). Stages not yet started may change,
    and so may what a branch may change about how the model computes."""
    if not (run_dir / "config.json").exists():
        return
    try:
        old = PretrainConfig.model_validate_json((run_dir / "config.json").read_text())
    except ValueError as e:  # written by a version that knew other fields or checks
        raise BranchError(f"{run_dir / 'config.json'}: the config this run was started with "
                          f"does not read as one now ({e})") from None
    made = [i for i, s in enumerate(old.stages) if (run_dir / "ckpt" / s.name).is_dir()]
    if not made and not (run_dir / "data" / "done.json").exists():
        return  # nothing made yet: a config mended after a failed start
    hint = (f"put them back, or branch a new run from this one "
            f"(dojo pretrain CONFIG --from {run_dir} --out-dir ...)")
    differ = _differing(old, cfg, _FREE_MODEL)
    if differ:
        raise BranchError(f"{run_dir}: this run was started with other {', '.join(differ)}; "
                          f"{hint}")
    # every stage up to the last one begun, in its place: each trained from the one before
    for i in range(max(made, default=-1) + 1):
        was = old.stages[i]
        if i >= len(cfg.stages):
            raise BranchError(f"{run_dir}: stage {was.name!r} has a checkpoint, and this "
                              f"config has no stage {i}; {hint}")
        before, now = was.model_dump(exclude=_FREE_STAGE), cfg.stages[i].model_dump(
            exclude=_FREE_STAGE)
        changed = [f"{k} {before[k]!r} -> {now[k]!r}" for k in now if before[k] != now[k]]
        if changed:
            raise BranchError(f"{run_dir}: stage {was.name!r} has a checkpoint made under other "
                              f"settings ({'; '.join(changed)}); {hint}")


def _differing(old: PretrainConfig, new: PretrainConfig, free_model: set[str]) -> list[str]:
    """The top-level fields of two configs that differ where a run's data and stages depend
    on them (the model's ``free_model`` fields and what is only reported aside)."""
    free = {**dict.fromkeys(_FREE, True), "model": free_model,
            "eval": {"every", "continuations"}}  # what is reported, not what runs
    a, b = old.model_dump(exclude=free), new.model_dump(exclude=free)
    return [k for k in a if a[k] != b[k]]  # one model: the same fields


def _done(ckpt: Path) -> bool:
    pos = position_of(ckpt)
    return pos is not None and pos.done


def _link(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system
        shutil.copy2(src, dst)


def _kept(report: dict[str, Any], stages: list[str]) -> dict[str, Any]:
    """The report entries of the base model and of ``stages``."""
    keep = {"base", *stages}
    return {**{key: {k: v for k, v in report.get(key, {}).items() if k in keep}
               for key in ("eval_loss", "mtp_agree", "mtp_agree_text", "stages")},
            "probe": {k: v for k, v in report.get("probe", {}).items()
                      if k.split("/")[0] in keep}}  # "<stage>/before", "<stage>/after"
