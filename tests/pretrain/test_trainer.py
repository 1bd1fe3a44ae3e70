from __future__ import annotations

import io
import json
import random
import shutil
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from codedojo.data.features import TokenFeatures
from codedojo.data.packing import Packed, PackedLoader, pack
from codedojo.data.shards import TokenShards
from codedojo.model.weights import load_model
from codedojo.pretrain.checkpoint import load_trainer_state, load_weights
from codedojo.pretrain.config import PretrainConfig, StageConfig, load_config
from codedojo.pretrain.optim import build_adamw
from codedojo.pretrain.parallel import apply_activation_checkpointing
from codedojo.pretrain.trainer import build_model, set_rope_scaling, train_stage
from tests.ops.conftest import needs_kernel
from tests.pretrain.tiny_run import five_stage_config


def _cfg(tmp_path, **stage) -> PretrainConfig:
    st = dict(name="bulk", seq_len=16, batch_size=2, steps=4, lr=1e-2, warmup_steps=1,
              checkpoint_every=2, mix=[{"data": "code"}])
    st.update(stage)
    if st["steps"] == 1:  # a step of warmup would leave none to the decay
        st.setdefault("decay_frac", 0.0)
    return PretrainConfig.model_validate({
        "name": "t", "out_dir": str(tmp_path), "corpus": {"sources": []},
        "model": {"base": "tiny", "n_mtp": 1, "tiny_overrides": {"vocab_size": 64}},
        "stages": [st]})


def _loader(seed: int = 0) -> PackedLoader:
    """Documents that count up from a random start (1 to 63, then 1 again): a few steps learn
    them, where uniform random tokens leave a fresh model's loss where it was."""
    rng = np.random.default_rng(0)
    p = pack([(s + np.arange(n)) % 63 + 1 for s, n in zip(rng.integers(0, 63, size=30),
                                                            rng.integers(5, 40, size=30),
                                                            strict=True)], seq_len=16)
    return PackedLoader(p, batch_size=2, seed=seed)


@pytest.mark.parametrize("mode", ["off", "joint"])
def test_resume_gives_bit_identical_losses(tmp_path, mode):
    cfg = _cfg(tmp_path, mtp=mode)
    torch.manual_seed(0)
    model, mtp = build_model(cfg)
    full = train_stage(cfg, 0, model, mtp, _loader(), tmp_path / "a")
    # interrupted run: two steps, checkpoint, then a fresh process-like restart
    cfg_b = cfg.model_copy(update={"out_dir": str(tmp_path / "b")})
    model, mtp = build_model(cfg_b)
    first = train_stage(cfg_b, 0, model, mtp, _loader(), tmp_path / "b", stop_after=2)
    torch.manual_seed(123)  # the checkpoint's RNG state must win over whatever is current
    model, mtp = build_model(cfg_b)
    ck = tmp_path / "b" / "ckpt" / "bulk"
    load_weights(ck, model, mtp)
    rest = train_stage(cfg_b, 0, model, mtp, _loader(), tmp_path / "b", resume_from=ck)
    assert first == full[:2]
    assert rest == full[2:]  # exact float equality
    assert full[-1] < full[0]


def test_a_resume_may_change_activation_checkpointing(tmp_path):
    """Activation checkpointing leaves the parameter names alone, so a run's optimizer state
    finds its parameters whether or not it recomputes; a state that fits no parameter is
    refused."""
    cfg = _cfg(tmp_path, mtp="joint")
    torch.manual_seed(0)
    model, mtp = build_model(cfg)
    full = train_stage(cfg, 0, model, mtp, _loader(), tmp_path / "a")
    model, mtp = build_model(cfg)
    apply_activation_checkpointing(model)
    first = train_stage(cfg, 0, model, mtp, _loader(), tmp_path / "b", stop_after=2)
    ck = shutil.copytree(tmp_path / "b" / "ckpt" / "bulk", tmp_path / "mid")
    model, mtp = build_model(cfg)
    load_weights(ck, model, mtp)
    rest = train_stage(cfg, 0, model, mtp, _loader(), tmp_path / "b", resume_from=ck)
    assert first + rest == full
    # the same checkpoint resumed by a stage that trains the model alone
    plain = _cfg(tmp_path, mtp="off")
    model, _ = build_model(plain)
    with pytest.raises(ValueError, match=r"does not match.*unexpected \['mtp\."):
        train_stage(plain, 0, model, None, _loader(), tmp_path / "b", resume_from=ck)


def test_a_checkpoint_of_an_older_version_resumes(tmp_path):
    """Its optimizer state is positional (`Optimizer.state_dict`): one process still loads it."""
    cfg = _cfg(tmp_path, mtp="off")
    torch.manual_seed(0)
    model, _ = build_model(cfg)
    full = train_stage(cfg, 0, model, None, _loader(), tmp_path / "a")
    model, _ = build_model(cfg)
    first = train_stage(cfg, 0, model, None, _loader(), tmp_path / "b", stop_after=2)
    ck = tmp_path / "b" / "ckpt" / "bulk"
    st = cfg.stages[0]
    opt = build_adamw(list(model.named_parameters()), st.lr, st.weight_decay, st.betas)
    load_trainer_state(ck, model, None, opt)
    rng = torch.load(ck / "trainer.pt", weights_only=False)["rng_ranks"][0]
    torch.save({"optimizer": opt.state_dict(), "rng": rng}, ck / "trainer.pt")
    model, _ = build_model(cfg)
    load_weights(ck, model)
    rest = train_stage(cfg, 0, model, None, _loader(), tmp_path / "b", resume_from=ck)
    assert first + rest == full


class _RunsCode:
    """Unpickled, it would write a file: what a trainer.pt from elsewhere could do."""

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(_RunsCode.target),))


def test_a_trainer_state_that_would_run_code_is_refused(tmp_path):
    import pickle

    cfg = _cfg(tmp_path, mtp="off")
    model, _ = build_model(cfg)
    train_stage(cfg, 0, model, None, _loader(), tmp_path / "b", stop_after=2)
    ck = tmp_path / "b" / "ckpt" / "bulk"
    _RunsCode.target = str(tmp_path / "ran")
    state = torch.load(ck / "trainer.pt", weights_only=False)
    torch.save({**state, "optimizer": _RunsCode()}, ck / "trainer.pt")
    st = cfg.stages[0]
    opt = build_adamw(list(model.named_parameters()), st.lr, st.weight_decay, st.betas)
    with pytest.raises(pickle.UnpicklingError):
        load_trainer_state(ck, model, None, opt)
    assert not (tmp_path / "ran").exists()


def test_a_distill_stage_leaves_no_expert_counts_behind(tmp_path):
    """A frozen (distill) stage routes tokens but moves no selection bias; the next stage's
    first bias update counts that stage's own tokens only."""
    moe = {"n_routed_experts": 8, "top_k": 2, "expert_ffn_dim": 16, "n_shared_experts": 1,
           "first_dense_layers": 0, "bias_update_speed": 0.01}

    def cfg(mtp: str) -> PretrainConfig:
        c = _cfg(tmp_path, mtp=mtp, steps=2, checkpoint_every=0)
        over = {**c.model.tiny_overrides, "moe": moe}
        return c.model_copy(update={"model": c.model.model_copy(update={"tiny_overrides": over})})

    def biases(model) -> list[torch.Tensor]:
        return [b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")]

    torch.manual_seed(0)
    model, mtp = build_model(cfg("off"))
    init = {k: v.clone() for k, v in model.state_dict().items()}
    train_stage(cfg("distill"), 0, model, mtp, _loader(1), tmp_path / "a")
    assert all(b.abs().sum() == 0 for b in biases(model))  # frozen: no update
    train_stage(cfg("off"), 0, model, None, _loader(), tmp_path / "a", stop_after=1)
    fresh, _ = build_model(cfg("off"))
    fresh.load_state_dict(init)
    train_stage(cfg("off"), 0, fresh, None, _loader(), tmp_path / "b", stop_after=1)
    assert any(b.abs().sum() > 0 for b in biases(fresh))
    assert all(torch.equal(a, b) for a, b in zip(biases(model), biases(fresh), strict=True))


def test_a_stage_trains_its_modules_on_its_greedy_share(tmp_path):
    """A stage's ``mtp_greedy`` reaches the loss: its first step's loss is `stage_loss`'s with
    that share, on the loader's first batch, before any update (the modules calibrated first,
    as a first MTP stage does)."""
    from codedojo.data.packing import make_batch
    from codedojo.pretrain.trainer import stage_loss

    first = {}
    for greedy in (0.0, 1.0):
        cfg = _cfg(tmp_path, mtp="joint", steps=1, checkpoint_every=0, mtp_greedy=greedy)
        torch.manual_seed(0)
        model, mtp = build_model(cfg)
        p = _loader().packed
        b = make_batch(p.tokens[:2], p.segments[:2], p.mask[:2])
        with torch.no_grad():
            mtp.calibrate(model.hidden(b["tokens"], positions=b["positions"],
                                       doc_ids=b["doc_ids"]))
            want, _ = stage_loss(model, mtp, _loader().next_batch(), "joint",
                                 cfg.stages[0].mtp_weight, mtp_greedy=greedy)
        first[greedy] = train_stage(cfg, 0, model, mtp, _loader(), tmp_path / str(greedy))[0]
        assert first[greedy] == pytest.approx(float(want), rel=1e-5)
    assert first[0.0] != pytest.approx(first[1.0], rel=1e-3)


@pytest.mark.parametrize("mode", ["distill", "joint"])
def test_a_stage_trains_modules_that_read_tapped_layers(tmp_path, mode):
    """`model.mtp_taps`: the modules' projections of the tapped layers start at zero (the
    loss is that of the same modules without them), are trained at the stage's
    `mtp_taps_lr_mult` times its learning rate, and the checkpoint keeps them."""
    import copy

    from codedojo.model.mtp import load_mtp
    from codedojo.pretrain.trainer import stage_loss

    moved = {}
    for mult in (10.0, 1.0):
        cfg = _cfg(tmp_path, mtp=mode, steps=3, lr=3e-3, checkpoint_every=0,
                   mtp_taps_lr_mult=mult)
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"mtp_taps": [0]})})
        torch.manual_seed(0)
        model, mtp = build_model(cfg)
        plain = copy.deepcopy(mtp)
        for layer in plain.layers:
            layer.fuse = None
        plain.taps = ()
        with torch.no_grad():
            tapped, untapped = (stage_loss(model, m, _loader().next_batch(), mode, 0.3)[0]
                                for m in (mtp, plain))
        assert torch.equal(tapped, untapped)
        out = tmp_path / str(mult)
        train_stage(cfg, 0, model, mtp, _loader(), out)
        moved[mult] = float(mtp.layers[0].fuse.weight.detach().abs().max())
        saved = load_mtp(out / "ckpt" / "bulk", model.cfg)
        assert saved is not None and saved.taps == (0,)
        assert torch.equal(saved.layers[0].fuse.weight, mtp.layers[0].fuse.weight)
    assert 0 < 3 * moved[1.0] < moved[10.0]
    with pytest.raises(ValueError, match="model.mtp_taps"):
        PretrainConfig.model_validate({**cfg.model_dump(), "model": {
            **cfg.model.model_dump(), "mtp_taps": [1, 0]}})


def test_modules_load_with_the_parts_a_branch_adds_and_nothing_else_missing(tmp_path):
    """A checkpoint of one-block modules that read no tapped layers loads into modules of two
    blocks that read one, the new parts as the modules start them (the block the identity, the
    projection at zero). A weight missing from a part the checkpoint has, or one it has that
    the modules lack, is an error that names it."""
    from safetensors.torch import load_file, save_file

    cfg = _cfg(tmp_path, mtp="joint", steps=1, checkpoint_every=0)
    model, mtp = build_model(cfg)
    train_stage(cfg, 0, model, mtp, _loader(), tmp_path / "run")
    ck = tmp_path / "run" / "ckpt" / "bulk"
    grown = cfg.model_copy(update={"model": cfg.model.model_copy(
        update={"mtp_blocks": 2, "mtp_taps": [0]})})
    model2, mtp2 = build_model(grown)
    load_weights(ck, model2, mtp2)
    for name, t in mtp.state_dict().items():  # what the checkpoint has, as it has it
        assert torch.equal(mtp2.state_dict()[name], t), name
    new = mtp2.layers[0].extra_blocks[0]
    assert not new.attn.wo.weight.any() and not new.mlp.w_down.weight.any()
    assert not mtp2.layers[0].fuse.weight.any()

    files = ck / "mtp.safetensors"
    saved = load_file(str(files))
    save_file({k: v for k, v in saved.items() if k != "layers.0.proj.weight"}, str(files))
    with pytest.raises(RuntimeError, match=r"missing \['layers.0.proj.weight'\]"):
        load_weights(ck, model, mtp)
    # a checkpoint of two-block modules, one weight of the extra block gone
    two = {k: v.clone() for k, v in mtp2.state_dict().items() if ".fuse." not in k}
    del two["layers.0.extra_blocks.0.attn.wo.weight"]
    save_file(two, str(files))
    plain2 = build_model(cfg.model_copy(update={"model": cfg.model.model_copy(
        update={"mtp_blocks": 2})}))[1]
    with pytest.raises(RuntimeError, match="extra_blocks.0.attn.wo.weight"):
        load_weights(ck, model, plain2)
    with pytest.raises(RuntimeError, match="unexpected"):  # into one-block modules
        load_weights(ck, model, mtp)


def test_distill_trains_only_mtp(tmp_path):
    cfg = _cfg(tmp_path, mtp="distill", steps=3, lr=3e-3)
    model, mtp = build_model(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mtp_before = {k: v.clone() for k, v in mtp.state_dict().items()}
    train_stage(cfg, 0, model, mtp, _loader(), tmp_path)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert any(not torch.equal(mtp_before[k], v) for k, v in mtp.state_dict().items())


@needs_kernel
def test_the_fused_decode_passes_compute_with_the_weights_a_stage_trained(tmp_path):
    """The CPU kernels keep a copy of the weights, packed on first use; the fused optimizer
    step writes the weights without telling them. After a stage's steps, the passes over a KV
    cache (self-generated data and its stored states, eval continuations, drafting) compute
    with the weights the stage trained, not with the ones packed before it."""
    import copy

    from codedojo.pretrain.selfgen import greedy_continue

    cfg = _cfg(tmp_path, mtp="joint", steps=3, checkpoint_every=0)
    model, mtp = build_model(cfg)
    assert mtp is not None
    prompts = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    h_prev = torch.randn(4, model.cfg.dim, generator=torch.Generator().manual_seed(1))

    def drafted(modules: Any) -> torch.Tensor:
        with torch.no_grad():
            out = modules.draft_step(1, h_prev, [3, 5, 7, 9], modules.new_caches(16)[0],
                                     model.tok_embeddings.weight, model.norm.weight,
                                     model.output_weight, rows=[0, 1, 2, 3])
        assert out is not None  # the kernel's pass
        return out[1]

    greedy_continue(model, prompts, 6)  # the kernels pack the weights as they are now
    drafted(mtp)
    train_stage(cfg, 0, model, mtp, _loader(), tmp_path / "run")
    op_by_op = copy.deepcopy(model)
    op_by_op.fuse = False
    got, want = [], []
    assert torch.equal(greedy_continue(model, prompts, 6, got),
                       greedy_continue(op_by_op, prompts, 6, want))
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(want, 1), rtol=1e-4, atol=1e-4)
    # a copy packs the weights it has (`FusedModule.__getstate__`)
    assert torch.equal(drafted(mtp), drafted(copy.deepcopy(mtp)))


def test_config_errors_name_the_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[corpus]\nsources = []\n[[stages]]\nname = "a"\nseq_len = 4\n'
                   'steps = 1\nmix = [{data = "code"}]\n')
    with pytest.raises(ValueError, match=r"stages\.0\.seq_len"):
        load_config(bad)
    bad.write_text('name = "x"\n[corpus]\nsources = []\n[[stages]]\nname = "a"\nseq_len = 16\n'
                   'steps = 1\nmtp = "distill"\nmix = [{data = "code"}]\n')
    with pytest.raises(ValueError, match="n_mtp"):
        load_config(bad)
    bad.write_text('name = "x"\n[model]\ndevice = "gpu"\n[corpus]\nsources = []\n[[stages]]\n'
                   'name = "a"\nseq_len = 16\nsteps = 1\nmix = [{data = "code"}]\n')
    with pytest.raises(ValueError, match=r"model\.device"):
        load_config(bad)


@pytest.mark.parametrize("setting, error", [
    ("stages.mtp.name=", r"stages\.1\.name: .* is not a plain name"),  # ckpt/ itself
    ('stages.mtp.name="."', r"stages\.1\.name: .* is not a plain name"),
    ("stages.mtp.name=a/b", r"stages\.1\.name: .* is not a plain name"),
    ('name=".."', r"name: .* is not a plain name"),
    ("stages.bulk.betas=[0.9, 1.5]", r"stages\.0\.betas\.1: Input should be less than 1"),
    ("long_docs_chars=[3000, 500]", r"long_docs_chars: \(3000, 500\) must be \(min, max\)"),
    ("stages=[]", r"stages: List should have at least 1 item"),
    ("sft_examples=0", r"stages\[3\] \(sft\): an `sft` mix entry, but no SFT data"),
    ("stages.long.rope_scaling.beta_slow=40.0", "beta_fast .* must be above beta_slow"),
    ("stages.mtp_self.seq_len=10", r"new_tokens = 16\) is packed whole, in a row of seq_len "
     r"\+ 1 = 11 tokens"),
    ('stages.mtp.name="base"', r"stages\[1\]\.name: \"base\" is taken: report\.json keeps the "
     "base model's figures under it"),
    ("model.n_mtp=32", r"stages\[1\] \(mtp\)\.seq_len 32: the stage trains MTP modules, and "
     r"model\.n_mtp 32 must be below it"),
])
def test_config_values_a_run_cannot_use_are_refused(tmp_path, setting, error):
    from codedojo.pretrain.config import apply_overrides

    raw = five_stage_config(tmp_path, "r").model_dump()
    raw["stages"][2]["rope_scaling"] = {"kind": "yarn", "factor": 2.0}
    with pytest.raises(ValueError, match=error):
        try:
            PretrainConfig.model_validate(apply_overrides(raw, [setting]))
        except ValidationError as e:  # as load_config words it
            raise ValueError("; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}"
                                       for x in e.errors())) from e
    with pytest.raises(ValueError, match="a directory, not a TOML file"):
        load_config(tmp_path)


@pytest.mark.parametrize("setting, error", [
    ("stages.bulk.seq_len=300", r"stages\[0\] \(bulk\)\.seq_len 300: the model has 256 "
     "positions"),
    ("eval.seq_len=400", r"eval\.seq_len 400: the model has 256 positions"),
    ("stages.mtp_self.seq_len=512 stages.mtp_self.self_gen.new_tokens=505",
     r"stages\[4\] \(mtp_self\)\.self_gen\.prompt_len \+ self_gen\.new_tokens 513: the model "
     r"has 512 positions"),
])
def test_lengths_past_the_models_positions_are_refused_before_training(tmp_path, setting, error):
    """A base change extends the positions to its stage's length (here 512 of 256); any
    other length past them is named before the first stage trains."""
    from codedojo.pretrain.config import apply_overrides
    from codedojo.pretrain.trainer import check_lengths

    raw = five_stage_config(tmp_path, "r").model_dump()
    raw["model"]["tiny_overrides"]["max_seq_len"] = 256
    raw["stages"][2]["seq_len"] = 512
    cfg = PretrainConfig.model_validate(raw)
    model, mtp = build_model(cfg)
    check_lengths(cfg, model.cfg)
    assert set_rope_scaling(model, mtp, cfg.stages[2]).max_seq_len == 512
    model(torch.zeros(1, 512, dtype=torch.long))  # every position has its rotation
    with pytest.raises(ValueError, match=error):
        check_lengths(PretrainConfig.model_validate(apply_overrides(raw, setting.split())),
                      build_model(cfg)[0].cfg)


def test_modules_may_draft_as_deep_as_a_row_of_their_stage_holds(tmp_path):
    """model.n_mtp below every MTP stage's seq_len trains (the deepest module on the row's
    first position); as long as a row, it is refused by the config. A stage that trains no
    module may be shorter."""
    raw = {"name": "t", "out_dir": str(tmp_path), "corpus": {"sources": []},
           "model": {"base": "tiny", "n_mtp": 15, "tiny_overrides": {"vocab_size": 64}},
           "stages": [dict(name="mtp", seq_len=16, batch_size=2, steps=1, decay_frac=0.0,
                           mtp="distill", mix=[{"data": "code"}]),
                      dict(name="short", seq_len=8, steps=1, decay_frac=0.0,
                           mix=[{"data": "code"}])]}
    cfg = PretrainConfig.model_validate(raw)
    model, mtp = build_model(cfg)
    (loss,) = train_stage(cfg, 0, model, mtp, _loader(), tmp_path / "run")
    assert np.isfinite(loss)
    raw["model"]["n_mtp"] = 16
    with pytest.raises(ValidationError, match=r"stages\[0\] \(mtp\)\.seq_len 16: the stage "
                                              r"trains MTP modules, and model\.n_mtp 16"):
        PretrainConfig.model_validate(raw)


def test_yarn_extends_the_models_own_length(tmp_path):
    """YaRN reaches out from the model's length before its first YaRN extension (here 256):
    by default, and for a second YaRN stage too; another original length is refused, naming
    the field and both lengths, before any stage trains."""
    from codedojo.pretrain.config import apply_overrides
    from codedojo.pretrain.trainer import check_lengths

    raw = five_stage_config(tmp_path, "r").model_dump(exclude_unset=True)
    raw["model"]["tiny_overrides"]["max_seq_len"] = 256
    raw["stages"][2]["rope_scaling"] = {"kind": "yarn", "factor": 2.0}
    raw["stages"][2]["seq_len"] = 512
    raw["stages"][3]["rope_scaling"] = {"kind": "yarn", "factor": 4.0}
    raw["stages"][3]["seq_len"] = 1024
    cfg = PretrainConfig.model_validate(raw)
    model, mtp = build_model(cfg)
    check_lengths(cfg, model.cfg)
    after = set_rope_scaling(model, mtp, cfg.stages[2])
    assert after.max_seq_len == 512 and after.rope_scaling.original_max_seq_len == 256
    after = set_rope_scaling(model, mtp, cfg.stages[3])
    assert after.max_seq_len == 1024 and after.rope_scaling.original_max_seq_len == 256
    assert after.rope_scaling.factor == 4.0
    with pytest.raises(ValueError, match=r"stages\[2\] \(long\)\.seq_len 513: the model has "
                                         "512 positions"):
        check_lengths(PretrainConfig.model_validate(
            apply_overrides(raw, ["stages.long.seq_len=513"])), build_model(cfg)[0].cfg)
    given = apply_overrides(raw, ["stages.long.rope_scaling.original_max_seq_len=8192"])
    with pytest.raises(ValueError, match=r"stage 'long': rope_scaling\.original_max_seq_len "
                                         r"8192: the model has 256 positions before its first "
                                         r"YaRN extension; leave the field out or set it to 256"):
        check_lengths(PretrainConfig.model_validate(given), build_model(cfg)[0].cfg)
    same = apply_overrides(raw, ["stages.long.rope_scaling.original_max_seq_len=256"])
    check_lengths(PretrainConfig.model_validate(same), build_model(cfg)[0].cfg)


def test_a_probe_too_short_for_its_passkey_is_refused_before_training(tmp_path):
    """The passkey's lines and 16 tokens of code must fit ``eval.probe_len``: a shorter one
    is refused, saying so, before the first stage trains."""
    from rich.console import Console

    from codedojo.model.tokenizer import load_tokenizer
    from codedojo.pretrain.probe import build_probe
    from codedojo.pretrain.trainer import run

    tok = load_tokenizer()
    with pytest.raises(ValueError, match=r"probe length 40 is too short: the passkey's lines "
                                         r"take \d+ tokens and at least 16 of code go around "
                                         r"them, \d+ in all"):
        build_probe(list(range(1000)), tok, 40, random.Random(0))
    five = five_stage_config(tmp_path, "short")
    cfg = five.model_copy(update={"stages": [five.stages[0], five.stages[2]],
                                  "eval": five.eval.model_copy(update={"probe_len": 40})})
    with pytest.raises(ValueError, match=r"eval\.probe_len 40, for stages\[1\] \(long\)\.probe: "
                                         r"probe length 40 is too short"):
        run(cfg, tok=tok, console=Console(quiet=True))
    assert not (cfg.run_dir / "ckpt").exists()  # no stage trained


def test_overrides_set_fields_and_name_what_is_wrong(tmp_path):
    from codedojo.pretrain.config import apply_overrides

    cfg = load_config("configs/cpt-smollm2.toml", [
        "stages.mtp_self.lr=3e-3", "stages.0.steps=7", "model.n_mtp=3", "out_dir=runs/exp",
        "stages.mtp_self.self_gen.prompts=64", "corpus.sources.0.exts=['.py', '.pyi']",
        "model.compile=false"])
    assert cfg.stages[4].lr == 3e-3 and cfg.stages[0].steps == 7 and cfg.model.n_mtp == 3
    assert cfg.out_dir == "runs/exp" and not cfg.model.compile
    assert cfg.stages[4].self_gen is not None and cfg.stages[4].self_gen.prompts == 64
    assert cfg.corpus.sources[0].exts == [".py", ".pyi"]
    base = load_config("configs/cpt-smollm2.toml")
    assert base.stages[4].lr == 5e-3 and base.model.n_mtp == 2  # the file itself is unchanged
    with pytest.raises(ValueError, match=r"stages has no item 'mtp_slef' \(5 items: bulk, "
                                         r"mtp, long, sft, mtp_self\)"):
        load_config("configs/cpt-smollm2.toml", ["stages.mtp_slef.lr=1e-3"])
    with pytest.raises(ValueError, match=r"with --set model\.n_mpt=3: model\.n_mpt: Extra"):
        load_config("configs/cpt-smollm2.toml", ["model.n_mpt=3"])
    with pytest.raises(ValueError, match=r"stages\.4\.lr: Input should be a valid number"):
        load_config("configs/cpt-smollm2.toml", ["stages.mtp_self.lr=fast"])
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        load_config("configs/cpt-smollm2.toml", ["model.n_mtp"])
    with pytest.raises(ValueError, match="model.n_mtp is a value, not a table"):
        load_config("configs/cpt-smollm2.toml", ["model.n_mtp.x=1"])
    # a stage's name may hold dots
    raw = {"stages": [{"name": "v1"}, {"name": "v1.5", "mix": [{"data": "code"}]}]}
    assert apply_overrides(raw, ["stages.v1.5.lr=3e-3", "stages.v1.5.mix.0.weight=2",
                                 "stages.v1.lr=1e-3"])["stages"] == [
        {"name": "v1", "lr": 1e-3}, {"name": "v1.5", "lr": 3e-3,
                                     "mix": [{"data": "code", "weight": 2}]}]


def test_repo_config_parses():
    cfg = load_config("configs/cpt-smollm2.toml")
    assert [s.name for s in cfg.stages] == ["bulk", "mtp", "long", "sft", "mtp_self"]
    assert cfg.stages[2].rope_scaling is not None and cfg.stages[2].probe
    assert cfg.stages[4].self_gen is not None and cfg.model.compile


def test_run_end_to_end_tiny(tmp_path):
    """Three stages plus MTP distillation (on code, then on the model's own continuations) on
    a tiny model with a real tokenizer and a small
    code corpus: report, probe, checkpoint with MTP, HF export."""
    from rich.console import Console

    from codedojo.model.tokenizer import load_tokenizer
    from codedojo.pretrain.trainer import run

    cfg = five_stage_config(tmp_path, "e2e")
    cfg.eval.every = 1  # held-out figures with every step too
    cfg.eval.continuations = 2  # and the drafts' agreement on the model's own text
    tok = load_tokenizer()
    report = run(cfg, tok=tok, console=Console(quiet=True))
    assert set(report["eval_loss"]) == {"base", "bulk", "mtp", "long", "sft", "mtp_self"}
    assert report["eval_loss"]["mtp"] == report["eval_loss"]["bulk"]  # frozen model
    assert report["eval_loss"]["mtp_self"] == report["eval_loss"]["sft"]
    # the modules' held-out agreement after the first stage that trains them and every later
    # one (SFT moves the model without them)
    for key in ("mtp_agree", "mtp_agree_text"):
        assert set(report[key]) == {"mtp", "long", "sft", "mtp_self"}
        assert all(len(a) == 1 and 0 <= a[0] <= 1 for a in report[key].values())
    logged = [json.loads(line) for line in
              (tmp_path / "runs" / "e2e" / "metrics.jsonl").read_text().splitlines()]
    assert len(logged) == 10 and all("eval_loss" in m for m in logged)
    assert [m["stage"] for m in logged if "eval_mtp_agree" in m] == [
        "mtp", "mtp", "long", "long", "sft", "sft", "mtp_self", "mtp_self"]
    last = {m["stage"]: m for m in logged}  # each stage's last step: its end's figures
    assert all(last[s]["eval_loss"] == report["eval_loss"][s] for s in last)
    assert all(last[s][f"eval_{key}"] == report[key][s] for key in ("mtp_agree", "mtp_agree_text")
               for s in report[key])
    (own_dir,) = (tmp_path / "runs" / "e2e" / "data" / "self").glob("mtp_self-*")
    own = TokenShards(own_dir)
    assert len(own) == 4 and own.doc_lengths().tolist() == [16] * 4
    # the stage trained on the hidden states stored with its text: rows packed with origins
    assert len(TokenFeatures(own_dir / "hidden")) == 64
    packed = tmp_path / "runs" / "e2e" / "data" / "packed"
    assert [(d.name.split("-")[0], (d / "origin.npy").exists())
            for d in sorted(packed.iterdir()) if d.name.startswith("mtp")] == [
        ("mtp", False), ("mtp_self", True)]
    assert set(report["probe"]) == {"long/before", "long/after"}
    final = tmp_path / "runs" / "e2e" / "final"
    assert (final / "mtp.safetensors").exists()
    assert json.loads((final / "model_config.json").read_text())["rope_theta"] == 40000.0
    assert (tmp_path / "runs" / "e2e" / "hf" / "config.json").exists()
    # `dojo serve` takes the checkpoint as it takes the HF export: same tokenizer, same logits
    text = "def scale(value):\n    return value * 2\n"
    assert load_tokenizer(str(final)).encode(text) == tok.encode(text)
    # and so does each stage's checkpoint (a `--from` branch's base, or served as it is)
    for stage in ("bulk", "mtp", "long", "sft", "mtp_self"):
        ckpt = tmp_path / "runs" / "e2e" / "ckpt" / stage
        assert load_tokenizer(str(ckpt)).fingerprint == tok.fingerprint, stage
    served, served_cfg = load_model(final)
    exported, _ = load_model(tmp_path / "runs" / "e2e" / "hf")
    assert served_cfg.rope_theta == 40000.0
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        torch.testing.assert_close(served(ids), exported(ids))
    again = run(cfg, tok=tok, console=Console(quiet=True))  # all stages skipped
    assert again["eval_loss"] == report["eval_loss"]
    assert again["mtp_agree"] == report["mtp_agree"]
    assert again["mtp_agree_text"] == report["mtp_agree_text"]
    # the config it ran with is kept beside the report
    kept = (tmp_path / "runs" / "e2e" / "config.json").read_text()
    assert PretrainConfig.model_validate_json(kept) == cfg


def test_an_moe_checkpoint_loads_for_serving(tmp_path):
    """An MoE model has no HF layout: `load_model` (so `dojo serve`) reads the training
    checkpoint itself, the experts' selection biases included."""
    from codedojo.model.config import ModelConfig, MoEConfig
    from codedojo.model.moe import moe_layers
    from codedojo.model.transformer import Transformer
    from codedojo.pretrain.checkpoint import TrainPosition, save_checkpoint

    cfg = ModelConfig.tiny(n_layers=3, moe=MoEConfig(n_routed_experts=8, top_k=2,
                                                     expert_ffn_dim=16, first_dense_layers=1))
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    for m in moe_layers(model):
        m.expert_bias.normal_()  # they choose the experts
    (tmp_path / ".ck-k1ll3d_x").mkdir()  # a save that was killed: removed by the next
    ck = save_checkpoint(tmp_path / "ck", model, cfg, None, None, TrainPosition(0, 0, {}, True))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    served, served_cfg = load_model(ck)
    assert served_cfg == cfg
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(served(ids), model(ids))
    (ck / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(ck)


@pytest.mark.parametrize("mode", ["distill", "joint"])
def test_the_first_mtp_stage_drafts_over_the_frequent_tokens_from_calibrated_modules(
        tmp_path, mode):
    cfg = _cfg(tmp_path, mtp=mode, steps=3, lr=3e-3)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"mtp_draft_vocab": 8})})
    model, mtp = build_model(cfg)
    calibrated: list[float] = []
    real = mtp.calibrate
    mtp.calibrate = lambda hidden: calibrated.append(real(hidden)) or calibrated[-1]
    rng = np.random.default_rng(0)  # whole documents: rows end in padding (the pad id 0)
    loader = PackedLoader(pack([rng.integers(1, 64, size=n) for n in rng.integers(5, 12, size=30)],
                               seq_len=16, allow_split=False), batch_size=2, seed=0)
    losses = train_stage(cfg, 0, model, mtp, loader, tmp_path)
    assert len(calibrated) == 1 and calibrated[0] > 0  # fresh modules: scaled to the model's
    text = loader.packed.segments >= 0  # (padding is no text to draft)
    assert 0 not in mtp.draft_vocab.tolist() and (loader.packed.tokens[~text] == 0).sum() > 50
    counts = np.bincount(loader.packed.tokens[text], minlength=64)
    chosen = mtp.draft_vocab.tolist()
    assert len(chosen) == 8 and chosen == sorted(chosen)
    assert min(counts[chosen]) >= max(np.delete(counts, chosen))  # the 8 most frequent
    assert all(np.isfinite(losses))
    model2, mtp2 = build_model(cfg)  # the checkpoint carries the vocabulary
    load_weights(tmp_path / "ckpt" / "bulk", model2, mtp2)
    assert mtp2.draft_vocab.tolist() == chosen


def test_rows_without_a_trained_position_are_left_out(tmp_path):
    """Long SFT prompts (loss on the answer only) fill whole rows with untrained tokens."""
    from codedojo.data.shards import ShardWriter
    from codedojo.pretrain.trainer import RunData, stage_packed

    w = ShardWriter(tmp_path / "sft", 64, eos_id=None)
    rng = np.random.default_rng(0)
    for _ in range(6):
        w.add(rng.integers(1, 64, size=40), [0] * 35 + [1] * 5)
    data = RunData({"sft": w.close()}, None, [])  # type: ignore[arg-type]
    cfg = _cfg(tmp_path, seq_len=8, steps=3, mix=[{"data": "sft"}])
    packed = stage_packed(cfg, cfg.stages[0], 0, data, tmp_path)
    assert len(packed) > 0 and packed.mask[:, 1:].any(axis=1).all()
    cfg = _cfg(tmp_path / "none", seq_len=8, steps=3, mix=[{"data": "sft"}])
    w = ShardWriter(tmp_path / "prompts", 64, eos_id=None)
    w.add(rng.integers(1, 64, size=40), [0] * 40)
    with pytest.raises(ValueError, match="'bulk': its data has no trained position"):
        stage_packed(cfg, cfg.stages[0], 0, RunData({"sft": w.close()}, None, []),  # type: ignore[arg-type]
                     tmp_path / "none")


def test_packed_cache_follows_the_stage_settings(tmp_path):
    """A resume with the same settings reads the same rows back; a config that changes the
    stage's length or mixture gets rows packed anew, not the stale cache."""
    from codedojo.data.shards import ShardWriter
    from codedojo.pretrain.trainer import RunData, stage_packed

    w = ShardWriter(tmp_path / "code", 64, eos_id=None)
    rng = np.random.default_rng(0)
    for _ in range(20):
        w.add(rng.integers(1, 64, size=30))
    data = RunData({"code": w.close()}, None, [])  # type: ignore[arg-type]
    run_dir = tmp_path / "run"
    cfg = _cfg(tmp_path, seq_len=8, steps=3)
    first = stage_packed(cfg, cfg.stages[0], 0, data, run_dir)
    again = stage_packed(_cfg(tmp_path, seq_len=8, steps=3), cfg.stages[0], 0, data, run_dir)
    assert np.array_equal(first.tokens, again.tokens)
    longer = _cfg(tmp_path, seq_len=16, steps=3)
    assert (stage_packed(longer, longer.stages[0], 0, data, run_dir).tokens.shape[1]
            == 2 * first.tokens.shape[1] - 1)
    assert len(list((run_dir / "data" / "packed").glob("bulk-*"))) == 2
    # two data-parallel ranks share the rows out: each still has rows for every step
    st = cfg.stages[0]
    assert len(first) >= st.steps * st.batch_size
    shared = stage_packed(cfg, st, 0, data, run_dir, world=2)
    assert len(shared) // 2 >= st.steps * st.batch_size and len(shared) >= 2 * len(first) - 1
    assert len(list((run_dir / "data" / "packed").glob("bulk-*"))) == 3


def _code_data(tmp_path):
    """A run's data of eight random 40-token documents of training code, for `self_data`."""
    from codedojo.data.shards import ShardWriter
    from codedojo.pretrain.trainer import RunData

    w = ShardWriter(tmp_path / "code", 64, eos_id=None)
    rng = np.random.default_rng(0)
    for _ in range(8):
        w.add(rng.integers(1, 64, size=40))
    return RunData({"code": w.close()}, None, [])  # type: ignore[arg-type]


def test_self_data_is_written_again_by_a_changed_model(tmp_path):
    """The self-generated text and its hidden states are found again by the weights that wrote
    them: the same weights read them back, and a model changed since (an earlier stage run
    again) writes its own rather than train on another model's hidden states."""
    from rich.console import Console

    from codedojo.pretrain.trainer import self_data

    data = _code_data(tmp_path)
    cfg = _cfg(tmp_path, mtp="distill", mix=[{"data": "self"}], self_gen={
        "prompts": 3, "prompt_len": 8, "new_tokens": 4, "batch": 2})
    model, _ = build_model(cfg)
    run_dir, quiet = tmp_path / "run", Console(quiet=True)
    first = self_data(cfg, cfg.stages[0], model, data, run_dir, quiet)
    (first / "index.json").write_text((first / "index.json").read_text() + " ")  # marked
    assert self_data(cfg, cfg.stages[0], model, data, run_dir, quiet) == first
    assert (first / "index.json").read_text().endswith(" ")  # read back, not written again
    with torch.no_grad():
        model.tok_embeddings.weight.add_(1e-2)
    other = self_data(cfg, cfg.stages[0], model, data, run_dir, quiet)
    assert other != first and len(TokenFeatures(other / "hidden")) == 3 * 12
    assert not torch.equal(TokenFeatures(other / "hidden").gather(np.arange(36)),
                           TokenFeatures(first / "hidden").gather(np.arange(36)))


def test_without_prompt_loss_the_modules_learn_only_where_the_next_token_is_generated(
        tmp_path):
    """``self_gen.prompt_loss = false`` reads the same continuations (nothing is generated
    again), trained only where the target is a generated token; its rows hold whole rows of
    the generation (a continuation is never cut from its prompt, as `pack` keeps a masked
    document whole)."""
    from rich.console import Console

    from codedojo.pretrain.trainer import self_data, stage_packed

    data = _code_data(tmp_path)
    gen = {"prompts": 6, "prompt_len": 8, "new_tokens": 4, "batch": 3}
    cfgs = [_cfg(tmp_path, mtp="distill", mix=[{"data": "self"}], steps=2,
                 self_gen={**gen, "prompt_loss": flag}) for flag in (True, False)]
    model, _ = build_model(cfgs[0])
    run_dir, quiet = tmp_path / "run", Console(quiet=True)
    dirs = [self_data(c, c.stages[0], model, data, run_dir, quiet) for c in cfgs]
    assert dirs[0] == dirs[1] and len(list((run_dir / "data" / "self").iterdir())) == 1
    data.shards["self"] = dirs[0]
    every, generated = (stage_packed(c, c.stages[0], 0, data, run_dir, origins=True)
                        for c in cfgs)
    starts = np.array([TokenShards(dirs[0]).doc_start(i) for i in range(6)])

    def places(p):  # each real token's place in its document, and which are real
        o = p.origin
        return o - starts[np.searchsorted(starts, o, side="right") - 1], o >= 0

    in_doc, real = places(every)
    assert (every.mask[real] == 1).all() and (in_doc[real] > 0).any()
    in_doc, real = places(generated)
    np.testing.assert_array_equal(generated.mask[real], (in_doc[real] >= 8).astype(np.uint8))
    assert 0 < generated.mask[real].sum() < real.sum()
    for p in (every, generated):  # every piece of a row starts its document: none is cut
        in_doc, real = places(p)
        first = np.ones_like(p.segments, dtype=bool)
        first[:, 1:] = p.segments[:, 1:] != p.segments[:, :-1]
        assert (in_doc[first & real] == 0).all()


def test_a_stage_packs_the_continuations_of_the_model_it_starts_from(tmp_path):
    """Two models write two `self` directories; the stage's packed rows follow the one it is
    given, and never come back from the cache of the other."""
    from rich.console import Console

    from codedojo.pretrain.trainer import self_data, stage_packed

    data = _code_data(tmp_path)
    cfg = _cfg(tmp_path, mtp="distill", mix=[{"data": "self"}], steps=2,
               self_gen={"prompts": 6, "prompt_len": 8, "new_tokens": 4, "batch": 3})
    run_dir, quiet = tmp_path / "run", Console(quiet=True)
    packs = []
    for seed in (0, 1):
        model, _ = build_model(cfg)
        torch.manual_seed(seed)
        with torch.no_grad():  # another model
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        data.shards["self"] = self_data(cfg, cfg.stages[0], model, data, run_dir, quiet)
        packs.append(stage_packed(cfg, cfg.stages[0], 0, data, run_dir))
        written = np.concatenate([TokenShards(data.shards["self"]).doc(i) for i in range(6)])
        real = packs[-1].tokens[packs[-1].mask.astype(bool)]
        assert set(real.tolist()) <= set(written.tolist())
    assert len(list((run_dir / "data" / "self").iterdir())) == 2
    assert not np.array_equal(packs[0].tokens, packs[1].tokens)


@needs_kernel  # (op by op, the continuations are the model's with or without the fix)
def test_a_self_gen_stage_trains_on_the_continuations_of_the_model_it_starts_from(tmp_path):
    """In one run whose eval continuations decode with the CPU kernels before later stages
    train the model, the `self` rows and the hidden states stored beside them are those of the
    model as the self_gen stage starts (here the final one: a distillation stage leaves it
    as it was)."""
    from rich.console import Console

    from codedojo.model.tokenizer import load_tokenizer
    from codedojo.pretrain import trainer
    from codedojo.pretrain.selfgen import greedy_continue

    raw = five_stage_config(tmp_path, "r", lr=1e-2).model_dump()
    raw["eval"]["continuations"] = 4
    cfg = PretrainConfig.model_validate(raw)
    trainer.run(cfg, tok=load_tokenizer(), console=Console(quiet=True))
    model, mtp = build_model(cfg)
    for st in cfg.stages:
        if st.rope_scaling is not None:
            set_rope_scaling(model, mtp, st)
    load_weights(cfg.run_dir / "final", model, mtp)
    (own,) = (cfg.run_dir / "data" / "self").glob("mtp_self-*")
    rows = TokenShards(own)
    g = cfg.stages[4].self_gen
    stored = torch.from_numpy(np.stack([rows.doc(i) for i in range(len(rows))]).astype(np.int64))
    assert torch.equal(greedy_continue(model, stored[:, :g.prompt_len], g.new_tokens), stored)
    with torch.no_grad():
        states = model.hidden(stored)
    kept = TokenFeatures(own / "hidden").gather(np.arange(stored.numel())).view(*stored.shape, -1)
    assert float((kept.float() - states).abs().amax() / states.abs().amax()) < 1e-2  # float16


def _stop_after_a_mid_stage_checkpoint(monkeypatch, trainer) -> Any:
    """`trainer.save_checkpoint` that stops the run once it has saved within a stage; returns
    the real one."""
    save = trainer.save_checkpoint

    def save_then_stop(*args, **kw):
        path = save(*args, **kw)
        if not args[5].done:  # the position: mid-stage
            raise KeyboardInterrupt
        return path

    monkeypatch.setattr(trainer, "save_checkpoint", save_then_stop)
    return save


def test_a_joint_stage_on_its_own_continuations_resumes_on_the_same_ones(tmp_path, monkeypatch):
    """The model moves in a joint stage: resumed from a mid-stage checkpoint, it reads the
    continuations written by the model the stage started from, not new ones of its own."""
    from rich.console import Console

    from codedojo.model.tokenizer import load_tokenizer
    from codedojo.pretrain import selfgen, trainer

    five = five_stage_config(tmp_path, "whole")
    (stage,) = [s.model_copy(update={"mtp": "joint", "steps": 4, "checkpoint_every": 2})
                for s in five.stages if s.name == "mtp_self"]
    cfg = five.model_copy(update={"stages": [stage]})
    tok, quiet = load_tokenizer(), Console(quiet=True)
    whole = trainer.run(cfg, tok=tok, console=quiet)
    save = _stop_after_a_mid_stage_checkpoint(monkeypatch, trainer)
    stopped = cfg.model_copy(update={"name": "stopped"})
    with pytest.raises(KeyboardInterrupt):
        trainer.run(stopped, tok=tok, console=quiet)
    monkeypatch.setattr(trainer, "save_checkpoint", save)
    calls: list[int] = []
    real = selfgen.greedy_continue
    monkeypatch.setattr(selfgen, "greedy_continue",
                        lambda m, x, *a, **k: calls.append(len(x)) or real(m, x, *a, **k))
    again = trainer.run(stopped, tok=tok, console=quiet)
    assert calls == []  # nothing generated again
    assert [p.name for p in (stopped.run_dir / "data" / "self").iterdir()] == \
        [p.name for p in (cfg.run_dir / "data" / "self").iterdir()]
    assert again["eval_loss"] == whole["eval_loss"]
    for name in ("model.safetensors", "mtp.safetensors"):
        assert ((stopped.run_dir / "final" / name).read_bytes()
                == (cfg.run_dir / "final" / name).read_bytes())


def test_an_mtp_distillation_step_detaches_the_modules_when_asked():
    """`stage_loss(..., mtp_detach=True)` (a stage's ``mtp_detach``): the first module's
    gradient is its own loss's alone, so it differs from the one that also serves module 2."""
    from codedojo.data.packing import make_batch
    from codedojo.model.config import ModelConfig
    from codedojo.model.mtp import MTP
    from codedojo.model.transformer import Transformer
    from codedojo.pretrain.trainer import stage_loss

    torch.manual_seed(0)
    cfg = ModelConfig.tiny(vocab_size=50, n_layers=2, n_mtp=2)
    model, mtp = Transformer(cfg), MTP(cfg)
    rows = np.random.default_rng(0).integers(0, 50, (2, 17))
    batch = make_batch(rows, np.zeros_like(rows), np.ones_like(rows, dtype=bool))
    grads, losses = [], []
    for detach in (False, True):
        mtp.zero_grad(set_to_none=True)
        loss, _ = stage_loss(model, mtp, batch, "distill", 1.0, mtp_detach=detach)
        loss.backward()
        losses.append(loss.detach())
        grads.append(mtp.layers[0].proj.weight.grad.clone())
    assert torch.equal(losses[0], losses[1])  # the same forward
    assert not torch.allclose(grads[0], grads[1])
    st = dict(name="s", seq_len=16, steps=1, mix=[{"data": "code"}])
    for knob, on in (("mtp_detach", True), ("mtp_greedy", 0.5)):
        StageConfig.model_validate({**st, knob: on, "mtp": "distill"})
        with pytest.raises(ValueError, match=f"stage 's': {knob} is for a stage that trains"):
            StageConfig.model_validate({**st, knob: on})  # mtp = "off"
    with pytest.raises(ValueError, match="mtp_greedy"):
        StageConfig.model_validate({**st, "mtp_greedy": 1.5, "mtp": "distill"})


def test_held_out_agreement_counts_drafts_equal_to_the_greedy_token_in_the_document(tmp_path):
    """`evaluate`'s agreement: per depth k, the share of positions i where module k's draft
    is what the main head picks greedily at i + k, over positions whose k + 1 next tokens are
    in the document. On the held-out text (``mtp_agree_text``), checked against each document
    scored alone, on packed rows of two documents and modules distilled a few steps (so they
    agree part of the time); on the model's continuations (``mtp_agree``), against the text's
    next tokens."""
    from codedojo.data.packing import make_batch
    from codedojo.data.shards import ShardWriter
    from codedojo.model.config import ModelConfig
    from codedojo.model.mtp import MTP
    from codedojo.model.transformer import Transformer
    from codedojo.pretrain.selfgen import greedy_continue, prompt_windows
    from codedojo.pretrain.trainer import continuations, evaluate, stage_loss

    torch.manual_seed(0)
    cfg = ModelConfig.tiny(n_layers=3, n_mtp=2)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # larger embeddings: the greedy picks vary with the input
        model.tok_embeddings.weight.mul_(8)
    mtp = MTP(cfg, taps=(1,), draft_vocab=128)
    rows = np.random.default_rng(0).integers(0, 16, (4, 49))  # draftable ids only
    sizes = (20, 29)  # two documents a row
    batch = make_batch(rows, np.repeat([[0] * sizes[0] + [1] * sizes[1]], 4, 0),
                       np.ones(rows.shape, dtype=bool))
    assert evaluate(model, None, [batch]).keys() == {"loss"}
    opt = torch.optim.AdamW(mtp.parameters(), 3e-3)
    for _ in range(12):
        loss, _ = stage_loss(model, mtp, batch, "distill", 1.0, mtp_greedy=1.0)
        loss.backward()
        opt.step()
        opt.zero_grad()
    got = evaluate(model, mtp, [batch])
    assert mtp.training  # left as it was
    assert "mtp_agree" not in got  # no continuations given

    hits, seen = [0, 0], [0, 0]
    with torch.no_grad():
        for row in torch.from_numpy(rows):
            for doc in row.split(sizes):
                doc = doc[None]
                n = doc.shape[1]
                hidden = model.hidden(doc, taps=(1,))
                greedy = model.head(hidden[..., :cfg.dim]).argmax(-1)[0]
                drafts = mtp.drafts(hidden, doc, torch.arange(n)[None], model.embed, model.greedy)
                for k in (1, 2):
                    for i in range(n - k - 1):  # token i + k + 1 is the document's
                        hits[k - 1] += int(drafts[k - 1][0, i] == greedy[i + k])
                        seen[k - 1] += 1
    on_text = [h / s for h, s in zip(hits, seen, strict=True)]
    assert all(0.2 < w < 1.0 for w in on_text), on_text  # neither all nor none
    assert got["mtp_agree_text"] == pytest.approx(on_text, abs=1e-9)
    assert got["loss"] == evaluate(model, None, [batch])["loss"]

    # On the model's own continuations the main head's greedy token is the text's next token:
    # a draft passes when it is that token, over the generated tokens only.
    writer = ShardWriter(tmp_path / "held", cfg.vocab_size, None)
    for doc in (rows[0, :20], rows[1], rows[2, 5:]):
        writer.add(doc)
    held = TokenShards(writer.close())
    continued = continuations(model, held, 3, 6, seed=0)
    windows = prompt_windows(held, 3, 6, seed=0)
    (b,) = continued
    whole = torch.cat([b["tokens"], b["targets"][:, -1:]], 1)
    assert torch.equal(whole, greedy_continue(model, torch.from_numpy(windows), 6))
    assert b["loss_mask"].tolist() == [[False] * 5 + [True] * 6] * 3  # targets 6..11
    with torch.no_grad():
        hidden = model.hidden(whole, taps=(1,))
        drafts = mtp.drafts(hidden, whole, torch.arange(12)[None], model.embed, model.greedy)
    right = [d[:, 5:12 - k - 1] == whole[:, 6 + k:] for k, d in enumerate(drafts, start=1)]
    want = [int(r.sum()) / r.numel() for r in right]
    got = evaluate(model, mtp, [batch], continued)
    assert got["mtp_agree"] == pytest.approx(want, abs=1e-9)
    assert got["mtp_agree_text"] == pytest.approx(on_text, abs=1e-9)


def test_a_stopped_run_goes_on_from_its_generation_and_from_its_stage(tmp_path, monkeypatch):
    """`dojo pretrain` stopped (killed, preempted) while it writes a stage's continuations, and
    again in the stage, after its first mid-stage checkpoint: started again each time, it says
    where it goes on from, writes only the continuations it had not, and ends as an unstopped
    run ends."""
    import functools
    import io

    from rich.console import Console

    from codedojo.model.tokenizer import load_tokenizer
    from codedojo.pretrain import selfgen, trainer

    five = five_stage_config(tmp_path, "whole")
    (stage,) = [s.model_copy(update={"steps": 4, "checkpoint_every": 2, "self_gen":
                                     s.self_gen.model_copy(update={"prompts": 8})})
                for s in five.stages if s.name == "mtp_self"]
    cfg = five.model_copy(update={"stages": [stage]})  # the modules distilled from the start
    tok, quiet = load_tokenizer(), Console(quiet=True)
    # stretches of two batches (of two rows): the part a hidden state of 32 floats in float16
    # fills with 2 x 2 rows of 16 tokens
    monkeypatch.setattr(trainer, "write_self_shards",
                        functools.partial(selfgen.write_self_shards, part_bytes=2 * 2 * 16 * 64))
    random.seed(1), np.random.seed(1)  # two processes start these from the OS's entropy
    whole = trainer.run(cfg, tok=tok, console=quiet)
    random.seed(2), np.random.seed(2)
    calls: list[int] = []
    real = selfgen.greedy_continue

    def stopping(m, x, *a, **k):
        calls.append(len(x))
        if len(calls) == 3:  # in the second stretch
            raise KeyboardInterrupt
        return real(m, x, *a, **k)

    monkeypatch.setattr(selfgen, "greedy_continue", stopping)
    save = _stop_after_a_mid_stage_checkpoint(monkeypatch, trainer)
    stopped = cfg.model_copy(update={"name": "stopped"})
    with pytest.raises(KeyboardInterrupt):
        trainer.run(stopped, tok=tok, console=quiet)
    calls.clear()
    out = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        trainer.run(stopped, tok=tok, console=Console(file=out, width=200))
    assert calls == [2, 2]  # the second stretch's batches only
    assert "mtp_self: 8 tokens after each of 8 prompts: going on from 4/8, where a stopped run" \
        " got to" in out.getvalue()
    (a,) = (cfg.run_dir / "data" / "self").glob("mtp_self-*")
    (b,) = (stopped.run_dir / "data" / "self").glob("mtp_self-*")
    assert (a / "shard_00000.bin").read_bytes() == (b / "shard_00000.bin").read_bytes()
    assert not (b / "progress").exists()
    monkeypatch.setattr(trainer, "save_checkpoint", save)
    out = io.StringIO()
    again = trainer.run(stopped, tok=tok, console=Console(file=out, width=200))
    assert "stage mtp_self: going on from step 2/4 (checkpoint)" in out.getvalue()
    assert calls == [2, 2]  # the continuations written: none made again
    assert again["eval_loss"] == whole["eval_loss"]
    assert ((stopped.run_dir / "final" / "mtp.safetensors").read_bytes()
            == (cfg.run_dir / "final" / "mtp.safetensors").read_bytes())  # trained alike
    for run in (cfg, stopped):  # and the trainer's state too: its RNG states are seeded
        assert (run.run_dir / "ckpt" / "mtp_self" / "trainer.pt").exists()
    assert ((stopped.run_dir / "ckpt" / "mtp_self" / "trainer.pt").read_bytes()
            == (cfg.run_dir / "ckpt" / "mtp_self" / "trainer.pt").read_bytes())


def test_the_logged_parts_of_the_loss_are_over_the_whole_step(tmp_path):
    """With micro-batches, each logged part of the loss is over all of them, as the loss is:
    the cross-entropy and the modules' loss add up to it."""
    cfg = _cfg(tmp_path, mtp="joint", grad_accum=2, steps=2, checkpoint_every=0)
    model, mtp = build_model(cfg)
    rows: list[dict] = []
    train_stage(cfg, 0, model, mtp, _loader(), tmp_path, log=rows.append)
    w = cfg.stages[0].mtp_weight
    for r in rows:
        assert r["loss"] == pytest.approx(r["ce"] + w * r["mtp_loss"], rel=1e-6)


@pytest.mark.parametrize("mode", ["off", "joint", "distill", "moe"])
def test_micro_batches_weigh_by_their_trained_tokens(tmp_path, mode):
    """Rows of 2 and of 16 trained tokens: one batch of four rows and two micro-batches of two
    take the same step, every trained token weighing alike, and every position an MTP depth
    trains on (the second depth has none in the short rows, so the micro-batches' shares of
    its positions are not those of their tokens), and every row in an MoE's balance loss (a
    mean over sequences)."""
    moe = {"moe": {"n_routed_experts": 4, "top_k": 2, "expert_ffn_dim": 16,
                   "seq_aux_loss_coef": 0.5}} if mode == "moe" else {}
    mode = "off" if mode == "moe" else mode
    p = _loader().packed
    mask = np.array(p.mask)
    mask[::2, 2:] = 0  # every other row trains its first two positions only
    masked = Packed(np.array(p.tokens), np.array(p.segments), mask)
    steps: list[dict] = []
    for batch, accum in ((4, 1), (2, 2)):
        cfg = _cfg(tmp_path / f"{batch}", batch_size=batch, grad_accum=accum, steps=1,
                   checkpoint_every=0, mtp=mode)
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={
            "n_mtp": 2, "tiny_overrides": {**cfg.model.tiny_overrides, **moe}})})
        torch.manual_seed(0)
        model, mtp = build_model(cfg)
        mtp.calibrate = lambda hidden: None  # (on a first micro-batch: of 4 rows, or of 2)
        train_stage(cfg, 0, model, mtp if mode != "off" else None,
                    PackedLoader(masked, batch, shuffle=False), tmp_path / f"{batch}",
                    log=steps.append)
    one, two = steps
    assert ("moe_aux" in one) == bool(moe)
    for part in ("loss", "grad_norm", "ce", "mtp_loss", "moe_aux"):  # the same loss and gradient
        assert (part in two) == (part in one), part
        if part in one:
            assert two[part] == pytest.approx(one[part], rel=1e-5), part


def test_a_stopped_stage_reports_and_logs_as_an_unstopped_one(tmp_path, monkeypatch):
    """Stopped after a step past its checkpoint, then again between its last checkpoint and
    its report: the run's log holds each step once, and its report every entry, the probe
    before the stage included, as a run never stopped has them."""
    from rich.console import Console

    from codedojo.model.tokenizer import load_tokenizer
    from codedojo.pretrain import trainer

    five = five_stage_config(tmp_path, "whole")
    (stage,) = [s.model_copy(update={"steps": 4, "checkpoint_every": 2})
                for s in five.stages if s.name == "long"]
    cfg = five.model_copy(update={"stages": [stage]})
    tok, quiet = load_tokenizer(), Console(quiet=True)
    whole = trainer.run(cfg, tok=tok, console=quiet)
    stopped = cfg.model_copy(update={"name": "stopped"})

    def stop_once(real, when):
        def stopping(*a, **k):
            if when(*a, **k):
                monkeypatch.setattr(trainer, real.__name__, real)
                raise KeyboardInterrupt
            return real(*a, **k)
        return stopping

    # at the fourth step (the checkpoint holds two, the log three)
    monkeypatch.setattr(trainer, "wsd_lr", stop_once(trainer.wsd_lr, lambda step, **k: step == 3))
    with pytest.raises(KeyboardInterrupt):
        trainer.run(stopped, tok=tok, console=quiet)
    on_disk = json.loads((stopped.run_dir / "report.json").read_text())
    assert on_disk["probe"]["long/before"] == whole["probe"]["long/before"]
    # after the last checkpoint, before the report
    monkeypatch.setattr(trainer, "evaluate", stop_once(trainer.evaluate, lambda *a, **k: True))
    with pytest.raises(KeyboardInterrupt):
        trainer.run(stopped, tok=tok, console=quiet)
    assert "long" not in json.loads((stopped.run_dir / "report.json").read_text())["stages"]
    out = io.StringIO()
    again = trainer.run(stopped, tok=tok, console=Console(file=out, width=200))
    assert "stage long: done (checkpoint), its figures not reported" in out.getvalue()
    for key in ("eval_loss", "probe", "stages"):
        assert again[key] == whole[key], key

    def logged(run):
        rows = trainer.read_metrics(run.run_dir / "metrics.jsonl")
        return [(m["step"], m["loss"]) for m in rows]

    assert logged(stopped) == logged(cfg) and [s for s, _ in logged(cfg)] == [1, 2, 3, 4]


def test_a_log_line_cut_short_by_a_kill_is_dropped_on_resume(tmp_path, monkeypatch):
    """A kill that cut the log's last row short (the checkpoint holds every step before it):
    the resumed run drops it, and logs and reports the step it runs again."""
    from rich.console import Console

    from codedojo.model.tokenizer import load_tokenizer
    from codedojo.pretrain import trainer

    five = five_stage_config(tmp_path, "whole")
    bulk = five.stages[0].model_copy(update={"steps": 3, "checkpoint_every": 2,
                                             "decay_frac": 0.0})
    cfg = five.model_copy(update={"stages": [bulk]})
    tok, quiet = load_tokenizer(), Console(quiet=True)
    whole = trainer.run(cfg, tok=tok, console=quiet)
    cut = cfg.model_copy(update={"name": "cut"})
    _stopped_at(monkeypatch, 2, cut, tok, quiet)  # the third step: the log holds two
    log = cut.run_dir / "metrics.jsonl"
    with log.open("a") as f:  # the third step's row, cut short
        f.write('{"stage": "bulk", "step": 3, "lo')
    again = trainer.run(cut, tok=tok, console=quiet)
    assert [m["step"] for m in trainer.read_metrics(log)] == [1, 2, 3]
    assert log.read_text().count("\n") == 3
    assert again["stages"] == whole["stages"]


def test_too_few_held_out_windows_for_the_continuations_are_refused_before_training(tmp_path):
    """eval.continuations, used once a stage trains MTP modules, asks the held-out code for
    more windows than it holds: refused, naming the field, before any stage trains."""
    from rich.console import Console

    from codedojo.model.tokenizer import load_tokenizer
    from codedojo.pretrain.trainer import run

    five = five_stage_config(tmp_path, "few")
    cfg = five.model_copy(update={"stages": five.stages[:2], "eval": five.eval.model_copy(
        update={"continuations": 5000})})
    with pytest.raises(ValueError, match=r"eval\.continuations, eval\.seq_len \(windows of "
                                         r"half its length\) of the held-out code: 5000 distinct "
                                         r"windows of 16 tokens asked for, and the code to draw "
                                         r"from holds \d+"):
        run(cfg, tok=load_tokenizer(), console=Console(quiet=True))
    assert not (cfg.run_dir / "ckpt").exists()  # no stage trained


def test_a_run_tokenizes_with_its_base_models_tokenizer(tmp_path):
    """A folder's own tokenizer, a checkpoint's too; SmolLM2's for a random tiny model."""
    from codedojo.model.tokenizer import DEFAULT_MODEL, load_tokenizer, tiny_tokenizer
    from codedojo.pretrain.trainer import base_tokenizer

    tiny_tokenizer().save(tmp_path / "hf")
    assert base_tokenizer(str(tmp_path / "hf")).fingerprint == tiny_tokenizer().fingerprint
    assert base_tokenizer("tiny").vocab_size == load_tokenizer(DEFAULT_MODEL).vocab_size


def test_a_stage_resumes_only_on_as_many_processes_as_it_was_started_on(tmp_path, monkeypatch):
    """Its rows are shared out by the processes, and the loader's position is in them: a
    stage stopped part-way by a run of two processes is not resumed by one."""
    from rich.console import Console

    from codedojo.model.tokenizer import load_tokenizer
    from codedojo.pretrain import trainer
    from codedojo.pretrain.checkpoint import read_position

    five = five_stage_config(tmp_path, "w")
    bulk = five.stages[0].model_copy(update={"steps": 4, "checkpoint_every": 2})
    cfg = five.model_copy(update={"stages": [bulk]})
    tok, quiet = load_tokenizer(), Console(quiet=True)
    _stopped_at(monkeypatch, 3, cfg, tok, quiet)
    state = cfg.run_dir / "ckpt" / "bulk" / "state.json"
    assert read_position(state.parent).world == 1
    pos = json.loads(state.read_text())
    state.write_text(json.dumps({**pos, "world": 2}))  # as a run of two processes leaves it
    with pytest.raises(ValueError, match=r"stage 'bulk' was started on 2 processes and goes on "
                                         r"only on as many \(1 now\): resume the run on 2"):
        trainer.run(cfg, tok=tok, console=quiet)
    state.write_text(json.dumps(pos))
    assert trainer.run(cfg, tok=tok, console=quiet)["stages"]["bulk"]["steps"] == 4


def test_the_probe_filler_reads_only_the_held_out_tokens_it_takes(tmp_path):
    from codedojo.data.shards import ShardWriter
    from codedojo.pretrain.trainer import _leading

    w = ShardWriter(tmp_path, 100, None)
    for i in range(5):
        w.add(list(range(10 * i, 10 * i + 10)))
    w.close()
    shards, read = TokenShards(tmp_path), []
    doc = shards.doc
    shards.doc = lambda i: (read.append(i), doc(i))[1]  # type: ignore[method-assign]
    assert np.concatenate(list(_leading(shards, 25))).tolist() == list(range(25))
    assert read == [0, 1, 2]  # (not the whole held-out set, concatenated and then cut)


def _stopped_at(monkeypatch: pytest.MonkeyPatch, step: int, cfg: PretrainConfig, tok: Any,
                console: Any) -> None:
    """`run` stopped (a KeyboardInterrupt) as it reaches step index ``step``."""
    from codedojo.pretrain import trainer

    real = trainer.wsd_lr

    def stop(at: int, **k: Any) -> float:
        if at == step:
            raise KeyboardInterrupt
        return real(at, **k)

    monkeypatch.setattr(trainer, "wsd_lr", stop)
    with pytest.raises(KeyboardInterrupt):
        trainer.run(cfg, tok=tok, console=console)
    monkeypatch.setattr(trainer, "wsd_lr", real)


def test_an_moe_step_balances_by_the_text_not_the_padding():
    """A stage's loss counts the load of the text's tokens, which moves the expert biases, not
    the padding's (one token, which would pile onto a few experts)."""
    from codedojo.data.packing import make_batch
    from codedojo.model.config import ModelConfig, MoEConfig
    from codedojo.model.moe import moe_layers
    from codedojo.model.transformer import Transformer
    from codedojo.pretrain.trainer import stage_loss

    cfg = ModelConfig.tiny(n_layers=2, moe=MoEConfig(n_routed_experts=8, top_k=2,
                                                     expert_ffn_dim=16, first_dense_layers=1))
    model = Transformer(cfg).train()
    tokens = np.random.default_rng(0).integers(1, cfg.vocab_size, (2, 13))
    segments = np.array([[0] * 13, [0] * 5 + [-1] * 8])  # inputs: 12 + 5 tokens of text
    stage_loss(model, None, make_batch(tokens, segments, segments >= 0), "off", 0.0)
    (m,) = moe_layers(model)
    assert m.tokens_per_expert.sum() == (12 + 5) * 2
