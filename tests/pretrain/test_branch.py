"""`dojo pretrain --from`: a run that starts from another's data and leading finished stages,
and leaves that run as it was."""

from __future__ import annotations

import json
import os

import pytest
import torch
from rich.console import Console

from codedojo.model.mtp import load_mtp
from codedojo.model.tokenizer import load_tokenizer
from codedojo.pretrain.branch import BranchError, branch_run
from codedojo.pretrain.checkpoint import load_weights
from codedojo.pretrain.trainer import build_model, run
from tests.pretrain.tiny_run import five_stage_config


def _files(d):
    return {p.relative_to(d): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_a_branch_runs_only_the_stages_its_config_changes(tmp_path):
    tok = load_tokenizer()
    quiet = Console(quiet=True)
    cfg = five_stage_config(tmp_path, "a")
    first = run(cfg, tok=tok, console=quiet)
    src = cfg.run_dir
    before = _files(src)

    # (saved more often is the same stage: it computes the same)
    stages = [s.model_copy(update={"lr": 3e-3}) if s.name == "mtp_self"
              else s.model_copy(update={"checkpoint_every": 1}) if s.name == "mtp" else s
              for s in cfg.stages]
    other = cfg.model_copy(update={"name": "b", "stages": stages})
    second = run(other, tok=tok, console=quiet, branch_from=src)
    dest = other.run_dir
    for name in ("bulk", "mtp", "long", "sft"):  # taken as they were: the same files
        assert (os.stat(dest / "ckpt" / name / "model.safetensors").st_ino
                == os.stat(src / "ckpt" / name / "model.safetensors").st_ino)
        assert second["eval_loss"][name] == first["eval_loss"][name]
        assert second["stages"][name] == first["stages"][name]
        assert second["mtp_agree_text"].get(name) == first["mtp_agree_text"].get(name)
    assert set(second["mtp_agree_text"]) == {"mtp", "long", "sft", "mtp_self"}
    assert set(second["probe"]) == {"long/before", "long/after"} and second["name"] == "b"
    # the changed stage ran again, from the same start, to another end
    ran, was = second["stages"]["mtp_self"], first["stages"]["mtp_self"]
    assert ran["first_loss"] == pytest.approx(was["first_loss"], rel=1e-5)
    assert ran["last_loss"] != was["last_loss"]
    assert (os.stat(dest / "ckpt" / "mtp_self" / "model.safetensors").st_ino
            != os.stat(src / "ckpt" / "mtp_self" / "model.safetensors").st_ino)
    assert json.loads((dest / "config.json").read_text())["stages"][4]["lr"] == 3e-3
    assert _files(src) == before  # the source run is untouched

    # again: the branch goes on as a run of its own
    assert run(other, tok=tok, console=quiet, branch_from=src)["eval_loss"] == second["eval_loss"]

    # an earlier stage changed: the data carries over, no checkpoint does
    bulk = [s.model_copy(update={"steps": 3}) if s.name == "bulk" else s for s in cfg.stages]
    assert branch_run(src, cfg.model_copy(update={"name": "c", "stages": bulk})) == []
    assert (tmp_path / "runs" / "c" / "data" / "done.json").exists()
    assert not (tmp_path / "runs" / "c" / "ckpt").exists()


def test_a_branch_grows_the_mtp_chain(tmp_path):
    """`--set model.n_mtp=2` on a branch of a one-module run: the stages before the last one
    that trains MTP modules are taken, the new module starts as a copy of the last, and that
    stage trains both on the continuations the source generated."""
    tok = load_tokenizer()
    quiet = Console(quiet=True)
    cfg = five_stage_config(tmp_path, "a")
    assert cfg.model.n_mtp == 1
    first = run(cfg, tok=tok, console=quiet)
    src = cfg.run_dir
    grown = cfg.model_copy(update={"name": "b",
                                   "model": cfg.model.model_copy(update={"n_mtp": 2})})
    second = run(grown, tok=tok, console=quiet, branch_from=src)
    dest = grown.run_dir
    for name in ("bulk", "mtp", "long", "sft"):
        assert (os.stat(dest / "ckpt" / name / "model.safetensors").st_ino
                == os.stat(src / "ckpt" / name / "model.safetensors").st_ino)
    assert second["eval_loss"]["sft"] == first["eval_loss"]["sft"]
    assert second["stages"]["mtp_self"]["first_loss"] != first["stages"]["mtp_self"]["first_loss"]
    assert len(list((dest / "data" / "self").iterdir())) == 1  # not generated again
    model, mtp = build_model(grown)
    load_weights(dest / "ckpt" / "sft", model, mtp)  # where the stage started
    start = [m.state_dict() for m in mtp.layers]
    assert all(torch.equal(start[1][k], start[0][k]) for k in start[0])
    end = load_mtp(dest / "final", model.cfg)
    assert end is not None and end.depth == 2
    for k, m in enumerate(end.layers):  # both trained from there
        assert not torch.equal(m.proj.weight, start[k]["proj.weight"])


def test_a_branch_gives_the_modules_tapped_layers(tmp_path):
    """`--set model.mtp_taps=[0]` on a branch of a run whose modules read none: the last stage
    that trains them runs again, from the source's modules with their new projections at zero,
    on the continuations the source generated, the tapped layer's states computed from them."""
    tok = load_tokenizer()
    quiet = Console(quiet=True)
    cfg = five_stage_config(tmp_path, "a")
    first = run(cfg, tok=tok, console=quiet)
    tapped = cfg.model_copy(update={"name": "b",
                                    "model": cfg.model.model_copy(update={"mtp_taps": [0]})})
    second = run(tapped, tok=tok, console=quiet, branch_from=cfg.run_dir)
    dest = tapped.run_dir
    for name in ("bulk", "mtp", "long", "sft"):
        assert (os.stat(dest / "ckpt" / name / "model.safetensors").st_ino
                == os.stat(cfg.run_dir / "ckpt" / name / "model.safetensors").st_ino)
    assert second["stages"]["mtp_self"]["steps"] == first["stages"]["mtp_self"]["steps"]
    model, mtp = build_model(tapped)
    made = list((dest / "data" / "self").iterdir())
    assert len(made) == 1  # not generated again
    assert json.loads((made[0] / "hidden-taps-0" / "index.json").read_text())[
        "dim"] == 2 * model.cfg.dim
    load_weights(dest / "ckpt" / "sft", model, mtp)  # where the stage started: the source's
    source = load_mtp(cfg.run_dir / "ckpt" / "sft", model.cfg)  # modules, reading no taps yet
    assert source is not None and source.taps == ()
    for name, t in source.state_dict().items():
        assert torch.equal(mtp.state_dict()[name], t)
    assert all(not m.fuse.weight.any() for m in mtp.layers)
    end = load_mtp(dest / "final", model.cfg)
    assert end is not None and end.taps == (0,)
    assert all(m.fuse.weight.any() for m in end.layers)  # trained from there


def test_a_branch_stacks_more_blocks_in_the_modules(tmp_path):
    """`--set model.mtp_blocks=2` on a branch: the last stage that trains the modules runs
    again from the source's modules, their second blocks starting as the identity (the modules
    draft as they did), and trains them."""
    tok = load_tokenizer()
    quiet = Console(quiet=True)
    cfg = five_stage_config(tmp_path, "a")
    run(cfg, tok=tok, console=quiet)
    deeper = cfg.model_copy(update={"name": "b",
                                    "model": cfg.model.model_copy(update={"mtp_blocks": 2})})
    run(deeper, tok=tok, console=quiet, branch_from=cfg.run_dir)
    dest = deeper.run_dir
    assert (os.stat(dest / "ckpt" / "sft" / "model.safetensors").st_ino
            == os.stat(cfg.run_dir / "ckpt" / "sft" / "model.safetensors").st_ino)
    model, mtp = build_model(deeper)
    assert mtp is not None and mtp.n_blocks == 2
    load_weights(dest / "ckpt" / "sft", model, mtp)  # where the stage started
    source = load_mtp(cfg.run_dir / "ckpt" / "sft", model.cfg)
    assert source is not None and source.n_blocks == 1
    for name, t in source.state_dict().items():
        assert torch.equal(mtp.state_dict()[name], t)
    new = [m.extra_blocks[0] for m in mtp.layers]
    assert all(not b.attn.wo.weight.any() and not b.mlp.w_down.weight.any() for b in new)
    end = load_mtp(dest / "final", model.cfg)
    assert end is not None and end.n_blocks == 2
    assert all(m.extra_blocks[0].mlp.w_down.weight.any() for m in end.layers)  # trained


def test_what_cannot_be_branched_is_named(tmp_path):
    cfg = five_stage_config(tmp_path, "a")
    src = cfg.run_dir
    src.mkdir(parents=True)
    with pytest.raises(BranchError, match="no config.json"):
        branch_run(src, cfg.model_copy(update={"name": "b"}))
    with pytest.raises(BranchError, match="no config.json"):  # the run leaves nothing behind
        run(cfg.model_copy(update={"name": "b"}), tok=load_tokenizer(),
            console=Console(quiet=True), branch_from=src)
    assert not (tmp_path / "runs" / "b").exists()
    (src / "config.json").write_text(cfg.model_dump_json())
    with pytest.raises(BranchError, match=f"runs under it: {src}$"):  # its out_dir given
        branch_run(src.parent, cfg.model_copy(update={"name": "b"}))
    with pytest.raises(BranchError, match="its seed differ"):
        branch_run(src, cfg.model_copy(update={"name": "b", "seed": 1}))
    model = cfg.model
    with pytest.raises(BranchError, match="its model differ"):  # what the model is
        branch_run(src, cfg.model_copy(update={
            "name": "b", "model": model.model_copy(update={"mtp_draft_vocab": 16})}))
    with pytest.raises(BranchError, match=r"model.n_mtp 1 -> 0: a branch may add MTP modules"):
        branch_run(src, cfg.model_copy(update={
            "name": "b", "model": model.model_copy(update={"n_mtp": 0})}))
    (src / "config.json").write_text(cfg.model_copy(update={"model": model.model_copy(
        update={"mtp_blocks": 2})}).model_dump_json())
    with pytest.raises(BranchError, match=r"model.mtp_blocks 2 -> 1: a branch may stack more"):
        branch_run(src, cfg.model_copy(update={"name": "b"}))
    (src / "config.json").write_text(cfg.model_dump_json())
    assert not (tmp_path / "runs" / "b").exists()
    # how it computes may change: precision, device, compile, checkpointing
    how = model.model_copy(update={"dtype": "bf16", "device": "cpu", "compile": True,
                                   "activation_checkpointing": True})
    assert branch_run(src, cfg.model_copy(update={"name": "d", "model": how})) == []
    assert (tmp_path / "runs" / "d").is_dir()
    # and how often it evaluates and on how many continuations, not on what
    often = cfg.eval.model_copy(update={"every": 5, "continuations": 8})
    assert branch_run(src, cfg.model_copy(update={"name": "f", "eval": often})) == []
    with pytest.raises(BranchError, match="its eval differ"):
        branch_run(src, cfg.model_copy(update={
            "name": "g", "eval": often.model_copy(update={"batches": 2})}))
    taken = tmp_path / "runs" / "b"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    with pytest.raises(BranchError, match="is not empty"):
        branch_run(src, cfg.model_copy(update={"name": "b"}))
    assert (taken / "notes.txt").read_text() == "mine"
    # the modules' taps may be given, not changed
    (src / "config.json").write_text(cfg.model_copy(update={"model": model.model_copy(
        update={"mtp_taps": [0]})}).model_dump_json())
    with pytest.raises(BranchError, match=r"model.mtp_taps \[0\] -> \[1\]"):
        branch_run(src, cfg.model_copy(update={
            "name": "e", "model": model.model_copy(update={"mtp_taps": [1]})}))


def test_a_run_goes_on_only_under_the_settings_it_was_started_with(tmp_path):
    """Its data and started stages were made by the settings it started with: a restart
    under others is refused by name; how often a stage is saved, and stages not yet begun,
    may change."""
    tok, quiet = load_tokenizer(), Console(quiet=True)
    five = five_stage_config(tmp_path, "r")
    cfg = five.model_copy(update={"stages": five.stages[:1]})
    run(cfg, tok=tok, console=quiet)
    longer = cfg.model_copy(update={"stages": [cfg.stages[0].model_copy(update={"steps": 3})]})
    with pytest.raises(BranchError, match=r"stage 'bulk' has a checkpoint made under other "
                                          r"settings \(steps 2 -> 3\); put them back, or branch"):
        run(longer, tok=tok, console=quiet)
    other_split = cfg.model_copy(update={"corpus": cfg.corpus.model_copy(
        update={"holdout_frac": 0.3})})
    with pytest.raises(BranchError, match=r"this run was started with other corpus"):
        run(other_split, tok=tok, console=quiet)
    saved_more = cfg.stages[0].model_copy(update={"checkpoint_every": 1})
    more = cfg.model_copy(update={"stages": [saved_more, five.stages[1]]})
    report = run(more, tok=tok, console=quiet)  # goes on: the new stage runs
    assert list(report["stages"]) == ["bulk", "mtp"]
    moved = cfg.model_copy(update={"stages": [five.stages[1], saved_more]})
    with pytest.raises(BranchError, match=r"stage 'bulk' has a checkpoint made under other "
                                          r"settings \(name 'bulk' -> 'mtp'; "):
        run(moved, tok=tok, console=quiet)
    renamed = cfg.model_copy(update={"stages": [saved_more.model_copy(
        update={"name": "bulk2"}), five.stages[1]]})
    with pytest.raises(BranchError, match=r"stage 'bulk' has a checkpoint made under other "
                                          r"settings \(name 'bulk' -> 'bulk2'\)"):
        run(renamed, tok=tok, console=quiet)
    (cfg.run_dir / "config.json").write_text('{"name": "r", "stages": [], "knob": 1}')
    with pytest.raises(BranchError, match=r"config.json: the config this run was started with "
                                          r"does not read as one now"):
        run(more, tok=tok, console=quiet)
