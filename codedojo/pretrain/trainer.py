"""One loop for every stage of continued pretraining.

The recipe, top to bottom (`run`):

1. data: corpus -> filters -> dedup -> held-out split -> token shards; derived sets: long
   documents (directory-level concatenations) and SFT conversations rendered by the chat
   renderer (loss on assistant tokens only). Cached under runs/<name>/data.
2. model: `load_model(base)` (or a random tiny model), MTP modules attached when asked.
3. per stage: apply its RoPE scaling; pack its mixture at its length; AdamW + WSD; steps of
   forward -> loss -> backward (grad accumulation, clipping) -> step -> MoE bias update;
   checkpoints (exact resume); eval loss on held-out code before/after; passkey probe
   before/after when asked.
4. report: eval loss per stage in runs/<name>/report.json; HF export of the final model.

Stages differ only in data and in the loss: `mtp = "distill"` freezes the model and trains the
MTP modules toward the main head (self-distillation from a mid-CPT checkpoint); `"joint"` adds the
distillation loss to the main loss. Departure from DeepSeek-V3: its MTP loss is cross-entropy on
the true tokens; we distil the main head, because a drafter is judged by agreement with the
target, not with the data.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from codedojo.data.features import TokenFeatures
from codedojo.data.mixture import MixtureSource, mix
from codedojo.data.packing import Packed, PackedLoader, make_batch, pack
from codedojo.data.shards import TokenShards
from codedojo.model.config import ModelConfig
from codedojo.model.moe import counting_tokens, moe_aux_loss, moe_layers, update_moe_biases
from codedojo.model.mtp import (
    MTP,
    distill_loss,
    draft_counts,
    mtp_positions,
    mtp_valid_mask,
    save_mtp,
)
from codedojo.model.rope import Rotary
from codedojo.model.transformer import Transformer
from codedojo.paths import write_atomic
from codedojo.pretrain.branch import branch_run, check_resume
from codedojo.pretrain.checkpoint import (
    TrainPosition,
    full_state_dict,
    load_trainer_state,
    load_weights,
    position_of,
    read_position,
    save_checkpoint,
    seed_rngs,
    weights_digest,
)
from codedojo.pretrain.config import PretrainConfig, StageConfig
from codedojo.pretrain.loss import linear_cross_entropy
from codedojo.pretrain.optim import build_adamw, set_lr, wsd_lr
from codedojo.pretrain.parallel import (
    apply_activation_checkpointing,
    apply_compile,
    apply_fsdp,
    average_gradients,
    barrier,
    broadcast_module,
    clip_grad_norm,
    gather_root,
    init_distributed,
    is_main,
    main_rank_first,
    mean_over_ranks,
    model_device,
    process_rank,
    sharded,
    sum_over_ranks,
    train_device,
    world_size,
)
from codedojo.pretrain.probe import Encoder, passkey_probe, probe_prompts
from codedojo.pretrain.selfgen import (
    continue_windows,
    draw_windows,
    features_dir,
    progress_dir,
    write_features,
    write_self_shards,
)
from codedojo.progress import progress

Batch = dict[str, torch.Tensor]


def on_device(batch: Batch, device: torch.device) -> Batch:
    """The batch's tensors on ``device`` (the loader builds them on the CPU)."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


# ---- losses -----------------------------------------------------------------------------------


def next_token_loss(model: Transformer, hidden: torch.Tensor, targets: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over trained positions, fused with the model's head (`loss.py`)."""
    return linear_cross_entropy(model.norm(hidden), model.output_weight, targets, mask)


def stage_loss(model: Transformer, mtp: MTP | None, batch: Batch, mode: str,
               mtp_weight: float, mtp_detach: bool = False, mtp_greedy: float = 0.0,
               share: float = 1.0, positions: Sequence[float] | None = None,
               rows_share: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one micro-batch, by stage kind (``mtp_detach``: `MTP.forward`'s,
    ``mtp_greedy``: `distill_loss`'s ``greedy``), and its parts. In a step of several
    micro-batches, each part is this micro-batch's share of the step's: the next-token loss is
    scaled by ``share`` (its share of the step's trained tokens), the MoE balance loss (a mean
    over sequences, trained or not) by ``rows_share`` (its share of the step's rows), and the
    MTP loss divided by ``positions``, the step's per depth (`distill_loss`). By default: the
    micro-batch's own mean."""
    tokens, targets, mask = batch["tokens"], batch["targets"], batch["loss_mask"]
    # the modules read the last hidden states, and the tapped layers' after them
    fwd = {"positions": batch["positions"], "doc_ids": batch["doc_ids"],
           "taps": mtp.taps if mtp is not None and mode != "off" else ()}
    vocab = mtp.draft_vocab if mtp is not None else None
    D = model.cfg.dim
    metrics: dict[str, float] = {}
    if mode == "distill":  # the main model is the frozen teacher, over the draft vocabulary
        with torch.no_grad():
            # its hidden states stored with the data (self-generated text), or computed
            hidden = batch["hidden"] if "hidden" in batch else model.hidden(tokens, **fwd)
            teacher = model.head(hidden[..., :D], vocab)
        loss = teacher.new_zeros(())
    else:  # next-token loss fused with the head (`loss.py`): no full-size logits
        with counting_tokens(model, batch["doc_ids"] >= 0):  # (MoE balancing: not the padding)
            hidden = model.hidden(tokens, **fwd)
        loss = next_token_loss(model, hidden[..., :D], targets, mask) * share
        metrics["ce"] = float(loss.detach())
        if mode == "joint":
            with torch.no_grad():
                teacher = model.head(hidden[..., :D], vocab)
    if mode in ("distill", "joint"):
        assert mtp is not None
        hs = mtp(hidden, tokens, batch["positions"], model.embed, batch["doc_ids"],
                 detach=mtp_detach)
        dl = distill_loss([model.head(h, vocab) for h in hs], teacher, mask, mtp_greedy,
                          positions)
        metrics["mtp_loss"] = float(dl.detach())
        loss = loss + (dl if mode == "distill" else mtp_weight * dl)
    aux = moe_aux_loss(model)
    if aux is not None and mode != "distill":
        loss = loss + aux * rows_share
        metrics["moe_aux"] = float(aux.detach()) * rows_share
    return loss, metrics


@torch.no_grad()
def evaluate(model: Transformer, mtp: MTP | None, batches: list[Batch],
             continued: Sequence[Batch] = ()) -> dict[str, Any]:
    """The held-out figures: ``loss``, the token-weighted next-token loss over ``batches``;
    with ``mtp``, per depth k the share of positions where module k's greedy draft is the main
    head's greedy token at i + k (where greedy speculative decoding accepts it), over positions
    whose k + 1 next tokens are trained: ``mtp_agree_text`` on ``batches`` (the held-out code
    as written), ``mtp_agree`` on ``continued`` (`continuations`: the model's own text, as the
    drafts meet it when serving, and as the modules train on it in a self-distillation
    stage)."""
    modes = [(mod, mod.training) for mod in (model, mtp) if mod is not None]
    for mod, _ in modes:
        mod.eval()
    dev = model_device(model)
    taps = mtp.taps if mtp is not None else ()
    D = model.cfg.dim
    tallies: dict[str, tuple[list[int], list[int]]] = {}  # figure -> hits, positions per depth

    def states(b: Batch) -> torch.Tensor:
        return model.hidden(b["tokens"], positions=b["positions"], doc_ids=b["doc_ids"],
                            taps=taps)

    def agreement(mtp: MTP, b: Batch, hidden: torch.Tensor, figure: str) -> None:
        hits, seen = tallies.setdefault(figure, ([0] * mtp.depth, [0] * mtp.depth))
        greedy = model.greedy(hidden[..., :D])  # (B, T): its pick for token i + 1
        # float32 modules on the states of a model sharded in bf16 (FSDP): as in training
        with torch.autocast(dev.type, hidden.dtype, enabled=hidden.dtype != torch.float32):
            drafts = mtp.drafts(hidden, b["tokens"], b["positions"], model.embed, model.greedy,
                                b["doc_ids"])
        for k, d in enumerate(drafts, start=1):  # d[:, i] drafts what greedy[:, i + k] picks
            valid = mtp_valid_mask(b["loss_mask"], k)
            hits[k - 1] += int((d == greedy[:, k:])[valid].sum())
            seen[k - 1] += int(valid.sum())

    tot, n = 0.0, 0
    for b in batches:
        b = on_device(b, dev)
        hidden = states(b)
        m = b["loss_mask"]
        tot += float(next_token_loss(model, hidden[..., :D], b["targets"], m)) * int(m.sum())
        n += int(m.sum())
        if mtp is not None:
            agreement(mtp, b, hidden, "mtp_agree_text")
    for b in continued:
        if mtp is not None:
            b = on_device(b, dev)
            agreement(mtp, b, states(b), "mtp_agree")
    for mod, was in modes:
        mod.train(was)
    return {"loss": tot / max(1, n),
            **{figure: [h / max(1, s) for h, s in zip(hits, seen, strict=True)]
               for figure, (hits, seen) in tallies.items()}}


def continuations(model: Transformer | None, held_out: TokenShards, n: int, length: int,
                  seed: int) -> list[Batch]:
    """``n`` distinct windows of ``length`` tokens of the held-out documents (half at a file's
    start, as `self_gen` draws its prompts), each continued greedily by ``model`` for as many
    tokens: `evaluate`'s ``continued`` rows, trained on the generated tokens only. ``model``
    None: the windows are only drawn (none returned), which refuses held-out code without
    ``n`` of them before any stage has trained."""
    try:
        if model is None:
            draw_windows(held_out, n, length, seed)
            return []
        rows = continue_windows(model, held_out, n, length, length, seed).numpy()
    except ValueError as e:
        raise ValueError(f"eval.continuations, eval.seq_len (windows of half its length) of "
                         f"the held-out code: {e}") from e
    mask = np.zeros(rows.shape, dtype=bool)
    mask[:, length:] = True
    docs = np.zeros_like(rows)  # one document a row
    return [make_batch(rows[i:i + 32], docs[i:i + 32], mask[i:i + 32]) for i in range(0, n, 32)]


# ---- model setup ------------------------------------------------------------------------------


def yarn_original_len(mcfg: ModelConfig) -> int:
    """The length a YaRN extension of the model reaches out from: its length before its first
    YaRN extension (the one it has, if any)."""
    rs = mcfg.rope_scaling
    return rs.original_max_seq_len if rs is not None and rs.kind == "yarn" else mcfg.max_seq_len


def config_after(mcfg: ModelConfig, stage: StageConfig) -> ModelConfig:
    """The model's config once ``stage``'s RoPE change is applied. Its positions grow to what
    the new tables reach, never fewer: YaRN's, the original length times the factor (its
    ``original_max_seq_len`` is the model's length before its first YaRN extension: that
    length when not given, refused when another); a base change's, the stage's length."""
    rs = stage.rope_scaling
    if rs is None:
        return mcfg
    if rs.kind == "base":
        return mcfg.model_copy(update={"rope_scaling": None, "rope_theta": rs.new_theta,
                                       "max_seq_len": max(mcfg.max_seq_len, stage.seq_len)})
    original = yarn_original_len(mcfg)
    if "original_max_seq_len" not in rs.model_fields_set:
        rs = rs.model_copy(update={"original_max_seq_len": original})
    elif rs.original_max_seq_len != original:
        raise ValueError(f"stage {stage.name!r}: rope_scaling.original_max_seq_len "
                         f"{rs.original_max_seq_len}: the model has {original} positions "
                         "before its first YaRN extension; leave the field out or set it to "
                         f"{original}")
    reach = int(rs.original_max_seq_len * rs.factor)
    return mcfg.model_copy(update={"rope_scaling": rs,
                                   "max_seq_len": max(mcfg.max_seq_len, reach)})


def check_lengths(cfg: PretrainConfig, mcfg: ModelConfig, tok: Encoder | None = None,
                  filler: Sequence[int] = ()) -> None:
    """Every length the run will use fits the model's positions as they are by then (``mcfg``
    before the first stage), and, given the tokenizer and the probe's ``filler``, every passkey
    probe fits its length: refused here, naming the field, rather than at that stage's first
    step after the others trained."""
    if cfg.eval.seq_len > mcfg.max_seq_len:
        raise ValueError(f"eval.seq_len {cfg.eval.seq_len}: the model has {mcfg.max_seq_len} "
                         "positions (max_seq_len)")
    for i, st in enumerate(cfg.stages):
        mcfg = config_after(mcfg, st)
        max_seq_len = mcfg.max_seq_len
        lengths = {"seq_len": st.seq_len}
        if st.self_gen is not None:
            lengths["self_gen.prompt_len + self_gen.new_tokens"] = (
                st.self_gen.prompt_len + st.self_gen.new_tokens)
        for what, n in lengths.items():
            if n > max_seq_len:
                raise ValueError(f"stages[{i}] ({st.name}).{what} {n}: the model has "
                                 f"{max_seq_len} positions (max_seq_len) by then; a stage "
                                 "with rope_scaling before it extends them")
        if st.probe and tok is not None:
            try:  # the probes as the stage's are drawn (`passkey_probe`)
                probe_prompts(filler, tok, min(cfg.eval.probe_len, max_seq_len),
                              cfg.eval.probe_trials, cfg.seed)
            except ValueError as e:
                raise ValueError(f"eval.probe_len {cfg.eval.probe_len}, for stages[{i}] "
                                 f"({st.name}).probe: {e}") from None


def set_rope_scaling(model: Transformer, mtp: MTP | None, stage: StageConfig) -> ModelConfig:
    """Context extension: new RoPE tables (YaRN or base change) for model and MTP; max_seq_len
    grows to what they reach (`config_after`)."""
    assert stage.rope_scaling is not None
    cfg = config_after(model.cfg, stage)
    model.cfg = cfg
    model.rotary = Rotary(cfg).to(model.tok_embeddings.weight.device)
    if mtp is not None:
        mtp.set_rope(cfg)
    return cfg


def build_model(cfg: PretrainConfig) -> tuple[Transformer, MTP | None]:
    if cfg.model.base == "tiny":
        mcfg = ModelConfig.tiny(**cfg.model.tiny_overrides)
        torch.manual_seed(cfg.seed)
        model = Transformer(mcfg)
    else:
        from codedojo.model.weights import load_model

        model, mcfg = load_model(cfg.model.base)
    model.train()
    mtp = None
    if cfg.model.n_mtp > 0:
        mtp = MTP(model.cfg, cfg.model.n_mtp, cfg.model.mtp_draft_vocab, cfg.model.mtp_taps,
                  cfg.model.mtp_blocks)
        try:
            mtp.init_from_model(model)
        except ValueError:
            pass  # an MoE last layer: keep the fresh init
        mtp.train()
    return model, mtp


# ---- data -------------------------------------------------------------------------------------


@dataclass
class RunData:
    shards: dict[str, Path]  # "code" / "long" / "sft" -> shard dirs
    eval: Packed
    probe_filler: list[int]
    prompts: dict[str, Path] = field(default_factory=dict)  # stage -> its `prompt_pool`


def cache_dir_for(root: Path, stage: StageConfig, settings: dict[str, Any]) -> Path:
    """``root/<stage>-<hash of settings>``: a stage's data cache, found again by a resume with
    the same settings and made anew when the config changes them."""
    key = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    return root / f"{stage.name}-{key.hexdigest()[:10]}"


def stage_packed(cfg: PretrainConfig, stage: StageConfig, si: int, data: RunData,
                 run_dir: Path, world: int = 1, origins: bool = False) -> Packed:
    """The stage's mixture packed at its length, cached on disk so a resume sees the same rows;
    rows without a trained position are left out. Enough rows for the stage's steps on each of
    ``world`` data-parallel ranks (they share the rows out). ``origins``: the rows record
    where their tokens are in the (one) source, for `stored_hidden`."""
    seed = cfg.seed + 1000 * si
    settings = {"seed": seed, **stage.model_dump(
        include={"seq_len", "batch_size", "grad_accum", "steps", "mix", "self_gen"})}
    if world > 1:
        settings["world"] = world
    if origins:
        settings["origins"] = True
    if any(e.data == "self" for e in stage.mix) and "self" in data.shards:
        settings["self"] = data.shards["self"].name  # whose continuations: another model's
        settings["self_whole"] = True  # packed whole since: rows packed before are not reused
    out = cache_dir_for(run_dir / "data" / "packed", stage, settings)
    if (out / "mask.npy").exists():
        return Packed.load(out)
    need = world * stage.steps * stage.grad_accum * stage.batch_size * (stage.seq_len + 1)
    g = stage.self_gen  # without the prompt's loss, its tokens are context only
    context = {"self": g.prompt_len} if g is not None and not g.prompt_loss else {}
    srcs = []
    for e in stage.mix:
        if e.data not in data.shards:
            raise ValueError(f"stages[{si}].mix: no {e.data!r} data in this run")
        # a continuation is packed whole: cut, its second piece would be trained without its
        # prompt, and its stored states (`stored_hidden`) were made with it
        srcs.append(MixtureSource(name=e.data, path=str(data.shards[e.data]), weight=e.weight,
                                  min_tokens=e.min_tokens, context_tokens=context.get(e.data, 0),
                                  whole=e.data == "self"))
    packed = pack(mix(srcs, need, seed=seed), stage.seq_len, origins=origins)
    # A conversation longer than a row leaves rows of prompt only: nothing to learn from them.
    trained = packed.mask[:, 1:].any(axis=1)
    if not trained.any():
        raise ValueError(f"stage {stage.name!r}: its data has no trained position")
    if not trained.all():
        packed = packed.rows(trained)
    packed.save(out)
    return Packed.load(out)


def stored_hidden(stage: StageConfig, data: RunData, taps: Sequence[int] = ()
                  ) -> TokenFeatures | None:
    """The frozen model's hidden states stored with the stage's data, when the stage can train
    on them instead of running the model: a distillation stage (the model does not change) whose
    one source is self-generated text with them stored beside it (the last layer's, and those
    of the ``taps`` the modules read)."""
    if not trains_on_stored(stage):
        return None
    feats = features_dir(data.shards["self"], taps)
    return TokenFeatures(feats) if (feats / "index.json").exists() else None


def trains_on_stored(stage: StageConfig) -> bool:
    """Whether the stage trains on stored hidden states (`stored_hidden`)."""
    return stage.mtp == "distill" and [e.data for e in stage.mix] == ["self"]


def self_data(cfg: PretrainConfig, stage: StageConfig, model: Transformer, data: RunData,
              run_dir: Path, console: Any) -> Path:
    """The stage's `self` shards: the model's continuations of windows of code (its prompt
    pool, else the training code), written once (a resumed stage reads them back). They are
    found again by the generation settings and by the weights that wrote them
    (`weights_digest`): a model changed since, by an earlier stage run again, writes its own,
    as its hidden states differ. Modules that read tapped layers find those layers' states
    beside the text too: kept by the generation, or computed from text written without them."""
    g = stage.self_gen
    assert g is not None
    if "code" not in data.shards:
        raise ValueError(f"stage {stage.name!r}: self_gen needs training code, and this run "
                         "has none")
    pool = data.prompts.get(stage.name, data.shards["code"])
    seed = cfg.seed + 31
    settings = {"seed": seed, **g.model_dump(exclude={"prompt_loss"}),  # not what is written
                "model": weights_digest(model, model.cfg)}
    taps = cfg.model.mtp_taps  # their states are kept beside the last ones
    # Generated as the stage trains: in bf16 under autocast for a bf16 stage, the faster (below).
    # A float32 generation gave no consistent gain to the drafts (`configs/cpt-smollm2.toml`).
    dtype = stage_dtype(cfg, stage)
    if dtype != "fp32":
        settings["dtype"] = dtype
    out = cache_dir_for(run_dir / "data" / "self", stage, settings)
    barrier()  # every rank sees the shards there, or none does
    if (out / "index.json").exists():
        feats = features_dir(out, taps)
        if trains_on_stored(stage) and not (feats / "index.json").exists():
            # text written before the modules read these layers: their states, from it
            rows = TokenShards(out)
            what = f"{stage.name}: the states of layers {taps} of {len(rows)} continuations"
            with _pass_progress(console, what, len(rows), feats) as (advance, resumed), \
                    _autocast(dtype, model_device(model)):
                write_features(model, rows, feats, taps, g.batch, process_rank(), world_size(),
                               advance, resumed)
            barrier()
        return out
    # Under FSDP every rank continues its own share of the prompts (each forward gathers the
    # shards from all of them); rank 0 gathers the continuations and writes them. A bf16 stage
    # generates under autocast: on a CPU the prefill of a batch of prompts is 2.8 times faster
    # (SmolLM2-135M, 64 x 96 tokens, 2.3 s against 6.5 s on 2 AVX-512 BF16 cores); the CPU
    # kernels' passes (decode steps, up to `FUSED_TOKENS` tokens) take no autocast and compute
    # in the weights' dtype, faster there than bf16 products op by op (0.06 s a step of 64 rows
    # against 0.12).
    what = f"{stage.name}: {g.new_tokens} tokens after each of {g.prompts} prompts"
    with _pass_progress(console, what, g.prompts, out) as (advance, resumed), \
            _autocast(dtype, model_device(model)):
        write_self_shards(
            model, TokenShards(pool), out, prompts=g.prompts,
            prompt_len=g.prompt_len, new_tokens=g.new_tokens, batch=g.batch,
            seed=seed, doc_start_frac=g.doc_start_frac, rank=process_rank(), world=world_size(),
            taps=taps, progress=advance, resumed=resumed)
    barrier()
    return out


@contextmanager
def _pass_progress(console: Any, what: str, total: int, out: Path) -> Iterator[
        tuple[Callable[[int], None], Callable[[int], None]]]:
    """A progress bar for a resumable pass over ``total`` rows into ``out``, and the pass's
    two callbacks: it has made n rows, and it goes on from a stopped run's n (which it says)."""
    with progress(console) as prog:
        task = prog.add_task(what, total=total)

        def resumed(n: int) -> None:
            console.print(f"{what}: going on from {n}/{total}, where a stopped run got to "
                          f"(its log: {progress_dir(out)})")
            prog.reset(task, completed=n)

        yield (lambda n: prog.update(task, completed=n)), resumed


def eval_batches(data: RunData, batch_size: int) -> list[Batch]:
    p = data.eval
    return [make_batch(p.tokens[i:i + batch_size], p.segments[i:i + batch_size],
                       p.mask[i:i + batch_size]) for i in range(0, len(p), batch_size)]


# ---- the loop ---------------------------------------------------------------------------------


def stage_dtype(cfg: PretrainConfig, stage: StageConfig) -> str:
    """The precision a stage runs in: its own, or else the model's."""
    return stage.dtype or cfg.model.dtype


def _autocast(dtype: str, device: torch.device) -> Any:
    if dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def _first_mtp(cfg: PretrainConfig) -> int:
    return next((i for i, s in enumerate(cfg.stages) if s.mtp != "off"), -1)


def train_stage(cfg: PretrainConfig, si: int, model: Transformer, mtp: MTP | None,
                loader: PackedLoader, run_dir: Path, resume_from: Path | None = None,
                log: Callable[[dict[str, Any]], None] | None = None,
                stop_after: int | None = None,
                held_out: Callable[[], dict[str, Any]] | None = None,
                tok: Any | None = None) -> list[float]:
    """Run stage `si` (from its start or from a mid-stage checkpoint). Returns per-step losses.
    `stop_after` ends early after that many steps of this call (tests). ``held_out``: the
    figures (`evaluate`'s) logged as ``eval_<name>`` with every ``cfg.eval.every``-th step.
    ``tok``: the run's tokenizer, saved in each checkpoint."""
    st = cfg.stages[si]
    sharded(model)  # under FSDP2: the parameters to freeze or train are the shards
    dev = model_device(model)
    if st.mtp == "distill":
        for p in model.parameters():
            p.requires_grad_(False)
        params = list(mtp.named_parameters()) if mtp is not None else []
    else:
        for p in model.parameters():
            p.requires_grad_(True)
        params = list(model.named_parameters())
        if mtp is not None and st.mtp == "joint":
            params += [(f"mtp.{n}", p) for n, p in mtp.named_parameters()]
    opt = build_adamw(params, st.lr, st.weight_decay, st.betas,
                      lambda name: st.mtp_taps_lr_mult if ".fuse." in name else 1.0)
    start = 0
    if resume_from is not None:
        pos = read_position(resume_from)
        load_trainer_state(resume_from, model, mtp, opt)
        loader.load_state_dict(pos.loader)
        start = pos.step
    if mtp is not None and resume_from is None and si == _first_mtp(cfg):
        # Fresh MTP modules (distilled or trained jointly): match their input scale to the
        # model's hidden states first, and draft over the data's most frequent tokens.
        b = make_batch(*(a[: st.batch_size] for a in (loader.packed.tokens,
                                                      loader.packed.segments,
                                                      loader.packed.mask)))
        b = on_device(b, dev)
        with torch.no_grad():
            hidden = model.hidden(b["tokens"], positions=b["positions"], doc_ids=b["doc_ids"])
        mtp.calibrate(hidden)
        if mtp.draft_vocab is not None:
            mtp.set_draft_vocab(draft_counts(loader.packed.tokens, loader.packed.segments,
                                             model.cfg.vocab_size))
    trainable = [p for _, p in params]
    losses = []
    gamma = model.cfg.moe.bias_update_speed if model.cfg.moe is not None else 0.0
    for m in moe_layers(model):  # the stage's first bias update counts its own tokens only
        m.tokens_per_expert.zero_()
    for step in range(start, st.steps):
        lr = wsd_lr(step, peak=st.lr, total=st.steps, warmup=st.warmup_steps,
                    decay_frac=st.decay_frac, min_ratio=st.min_lr_ratio)
        set_lr(opt, lr)
        t0 = time.perf_counter()
        # Every trained token of the step weighs alike, whichever micro-batch and rank it is
        # in: a micro-batch's mean loss counts by its share of the step's tokens (ranks'
        # gradients are averaged, hence the world size). Equal means of unequal micro-batches
        # would weigh an SFT row of 3 trained tokens as one of 300.
        micro = [loader.next_batch() for _ in range(st.grad_accum)]
        counts = [int(b["loss_mask"].sum()) for b in micro]
        ntok = sum(counts)
        # every trained token of the step weighs alike, and every position of an MTP depth:
        # the step's numbers (per rank, as gradients are averaged over ranks)
        depths = mtp_positions([b["loss_mask"] for b in micro], mtp.depth) \
            if mtp is not None and st.mtp != "off" else []
        step_tokens, *per_depth = (max(1.0, x) for x in mean_over_ranks(float(ntok), *depths))
        positions = per_depth or None
        total, parts = 0.0, {}  # the loss and its parts, over the step's tokens
        for batch, n in zip(micro, counts, strict=True):
            batch = on_device(batch, dev)
            if "hidden" in batch:  # no forward of the model gathers what the modules share
                gather_root(model)
            with _autocast(stage_dtype(cfg, st), dev):
                loss, part = stage_loss(model, mtp, batch, st.mtp, st.mtp_weight,
                                        st.mtp_detach, st.mtp_greedy, n / step_tokens,
                                        positions, 1 / len(micro))  # rows alike a batch
            loss.backward()
            total += float(loss.detach())
            for k, v in part.items():
                parts[k] = parts.get(k, 0.0) + v
        average_gradients(trainable)  # those FSDP does not shard (no-op on one process)
        gnorm = clip_grad_norm(trainable, st.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if gamma > 0 and st.mtp != "distill":
            for m in moe_layers(model):
                sum_over_ranks(m.tokens_per_expert)  # every rank's biases move alike
            update_moe_biases(model, gamma)
        # the fused step leaves the weights' version counters alone: the decode kernels'
        # packed copies of them (self-generation, eval continuations) are dropped by hand
        for mod in (model, mtp):
            if mod is not None:
                mod.weights_changed()
        # the loss of the whole batch; tokens per second of all ranks together
        total, tok_s, *means = mean_over_ranks(total, ntok / (time.perf_counter() - t0),
                                               *parts.values())
        tok_s *= world_size()
        metrics = dict(zip(parts, means, strict=True))
        losses.append(total)
        every = cfg.eval.every
        if held_out is not None and every and (step + 1) % every == 0:
            metrics.update({f"eval_{k}": v for k, v in held_out().items()})
        if log is not None:
            log({"stage": st.name, "step": step + 1, "loss": total, "lr": lr,
                 "grad_norm": float(gnorm), "tok_s": tok_s, **metrics})
        done = step + 1 == st.steps
        if (st.checkpoint_every and (step + 1) % st.checkpoint_every == 0) or done:
            # a finished stage is never resumed: its optimizer state would be gathered for nothing
            save_checkpoint(run_dir / "ckpt" / st.name, model, model.cfg, mtp,
                            None if done else opt,
                            TrainPosition(si, step + 1, loader.state_dict(), done,
                                          world_size()), tokenizer=tok)
        if stop_after is not None and len(losses) >= stop_after:
            break
    return losses


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a run's ``metrics.jsonl`` (none when there is no file); a last line cut
    short by a kill is left out."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return rows


def prepare_data(cfg: PretrainConfig, tok: Any, run_dir: Path) -> RunData:
    """Build (or reuse) the run's shards, eval set and probe filler."""
    from codedojo.data.corpus import build_corpus, concat_by_dir
    from codedojo.data.sft import code_sft_examples, read_sft_jsonl, render_to_shards
    from codedojo.data.shards import tokenize_to_shards

    d = run_dir / "data"
    vocab, eos = tok.vocab_size, tok.eos_id
    shards = {"code": d / "train", "long": d / "long", "sft": d / "sft"}
    made_by = getattr(tok, "fingerprint", None)
    if (d / "done.json").exists():
        was = json.loads((d / "done.json").read_text()).get("tokenizer")
        if made_by is not None and was != made_by:  # (none recorded: made before they were)
            raise ValueError(f"{d}: the data was tokenized by another tokenizer ({was}, this one "
                             f"is {made_by}): start the run anew in another directory")
    else:
        check_inputs(cfg)
        _, _, stats, train_docs = build_corpus(cfg.corpus, tok, d, vocab, eos)
        lo, hi = cfg.long_docs_chars
        tokenize_to_shards(concat_by_dir(train_docs, lo, hi), tok, shards["long"], vocab, eos)
        if cfg.sft_examples > 0 or cfg.sft_jsonl:
            from codedojo.model.chat import ChatTemplate

            tmpl = ChatTemplate(tok)

            def convs() -> Any:
                yield from code_sft_examples(train_docs, cfg.sft_examples)
                if cfg.sft_jsonl:
                    yield from read_sft_jsonl(cfg.sft_jsonl)

            render_to_shards(convs(), tmpl.render_with_mask, shards["sft"], vocab, eos)
        write_atomic(d / "done.json", json.dumps({
            "read": stats.read, "rejected": dict(stats.rejected),
            "exact_dupes": stats.dedup.exact_dupes, "near_dupes": stats.dedup.near_dupes,
            "train_docs": stats.train_docs, "eval_docs": stats.eval_docs,
            "dropped_bytes_docs": stats.dropped_bytes_docs, "tokenizer": made_by}))
    e = cfg.eval
    ev_dir = d / f"eval_packed_{e.seq_len}x{e.batches * e.batch_size}"
    if not (ev_dir / "mask.npy").exists():  # depends on the eval settings only
        ev = TokenShards(d / "eval")
        packed = pack((ev.doc(i) for i in range(len(ev))), e.seq_len,
                      max_rows=e.batches * e.batch_size)
        packed.save(ev_dir)
    filler_f = d / f"probe_filler_{e.probe_len}.npy"
    if not filler_f.exists():
        ev = TokenShards(d / "eval")
        buf = io.BytesIO()  # a file half written by a killed process would never be read
        np.save(buf, np.concatenate(list(_leading(ev, 4 * e.probe_len))))
        write_atomic(filler_f, buf.getvalue())
    shards = {k: v for k, v in shards.items() if (v / "index.json").exists()}
    prompts = {st.name: prompt_pool(cfg, st, tok, d) for st in cfg.stages
               if st.self_gen is not None and st.self_gen.sources and "code" in shards}
    return RunData(shards, Packed.load(ev_dir), np.load(filler_f).tolist(), prompts)


def _leading(shards: TokenShards, n: int) -> Iterator[np.ndarray]:
    """The first ``n`` tokens of ``shards``' documents, one after another, read no further."""
    for i in range(len(shards)):
        if n <= 0:
            return
        yield (doc := shards.doc(i)[:n])
        n -= len(doc)


def check_inputs(cfg: PretrainConfig) -> None:
    """The files the data is made from are all there: a missing one is named before any is
    read and tokenized (minutes on a real corpus), not when its turn comes."""
    from codedojo.data.readers import resolve_path

    named = [(f"corpus.sources[{i}].path", resolve_path(s.path))
             for i, s in enumerate(cfg.corpus.sources)]
    named += [(f"stages[{i}].self_gen.sources[{k}].path", resolve_path(s.path))
              for i, st in enumerate(cfg.stages) if st.self_gen is not None
              for k, s in enumerate(st.self_gen.sources)]
    named += [("sft_jsonl", Path(cfg.sft_jsonl))] if cfg.sft_jsonl else []
    for what, path in named:
        if not path.exists():
            raise FileNotFoundError(f"{what}: {path} does not exist")


def prompt_pool(cfg: PretrainConfig, stage: StageConfig, tok: Any, d: Path) -> Path:
    """The code a self_gen stage with `sources` draws its prompts from: the training code's
    documents, then the sources' files, filtered and deduplicated as the corpus is. A file whose
    tokens equal a corpus document's is left out: held-out code stays unseen by the drafts, and
    no window is drawn twice."""
    from codedojo.data.corpus import CorpusConfig, clean_documents
    from codedojo.data.shards import ShardWriter, document_ids

    g = stage.self_gen
    assert g is not None and g.sources
    corpus = cfg.corpus.model_dump(include={"filters", "dedup"})
    out = cache_dir_for(d / "prompts", stage, {"sources": g.model_dump()["sources"], **corpus})
    if (out / "index.json").exists():
        return out
    train, held = TokenShards(d / "train"), TokenShards(d / "eval")

    def key(ids: np.ndarray) -> bytes:
        return hashlib.sha1(ids.astype(np.int64).tobytes()).digest()

    seen = {key(s.doc(i)) for s in (train, held) for i in range(len(s))}
    w = ShardWriter(out, tok.vocab_size, tok.eos_id)
    for i in range(len(train)):
        w.add(train.doc(i))
    extra = CorpusConfig(sources=g.sources, filters=cfg.corpus.filters, dedup=cfg.corpus.dedup)
    kept = 0
    for doc in clean_documents(extra):
        ids = np.asarray(document_ids(tok, doc.text, tok.eos_id), np.int64)  # as the corpus's
        k = key(ids)
        if k not in seen:
            seen.add(k)
            w.add(ids)
            kept += 1
    if kept == 0:  # the directory stays unfinished (no index): a corrected config writes it
        raise ValueError(f"stage {stage.name!r}: self_gen.sources hold no file that passes the "
                         "corpus's filters and is not a corpus document already; check their "
                         "paths, exts and exclude")
    return w.close()


def base_tokenizer(base: str) -> Any:
    """The base model's own tokenizer (a checkpoint of a run holds its run's); SmolLM2's for
    a random tiny model."""
    from codedojo.model.tokenizer import load_tokenizer

    return load_tokenizer() if base == "tiny" else load_tokenizer(base)


def run(cfg: PretrainConfig, tok: Any | None = None, console: Any | None = None,
        branch_from: str | Path | None = None) -> dict[str, Any]:
    """The whole job. Idempotent: finished stages are skipped, a stage with a mid-stage
    checkpoint resumes from it. ``branch_from``: a run directory whose data and leading
    finished stages a new run starts from (`branch_run`); a run already begun goes on."""
    from rich.console import Console
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn

    console = console or Console()
    run_dir = cfg.run_dir
    seed_rngs(cfg.seed)
    if tok is None:
        tok = base_tokenizer(cfg.model.base)
    dev = train_device(cfg.model.device)
    rank, world = init_distributed(dev)  # under torchrun: data parallel over `world` processes
    if rank != 0:
        console = Console(quiet=True)  # rank 0 speaks for all
    if branch_from is not None:
        with main_rank_first():
            if rank == 0 and (run_dir / "config.json").exists():
                console.print(f"{run_dir} holds a run already: it goes on (--from not applied)")
            elif rank == 0:
                reused = branch_run(branch_from, cfg)
                console.print(f"branched from {branch_from}: its data"
                              + (f" and stages {', '.join(reused)}" if reused else ""))
    run_dir.mkdir(parents=True, exist_ok=True)  # after a branch: one refused leaves none
    check_resume(run_dir, cfg)
    if rank == 0:  # what this run was last started with, `--set` overrides applied
        write_atomic(run_dir / "config.json", cfg.model_dump_json(indent=1))
    model, mtp = build_model(cfg)  # before the data: what makes it fail is named at once
    console.print(f"[bold]{cfg.name}[/]: preparing data under {run_dir / 'data'}"
                  + (f" ({world} processes)" if world > 1 else ""))
    with main_rank_first():
        data = prepare_data(cfg, tok, run_dir)
    check_lengths(cfg, model.cfg, tok, data.probe_filler)

    def continue_held_out(m: Transformer | None) -> list[Batch]:
        """`continuations` of the held-out code, as eval.continuations asks for them."""
        return continuations(m, TokenShards(run_dir / "data" / "eval"), cfg.eval.continuations,
                             cfg.eval.seq_len // 2, cfg.seed + 77)

    if cfg.eval.continuations and _first_mtp(cfg) >= 0:
        # held-out code short of windows: refused now, not once the stages before the first
        # MTP one have trained
        continue_held_out(None)
    model.to(dev)
    if mtp is not None:
        mtp.to(dev)
    if cfg.model.compile:
        apply_compile(model, mtp)
    if cfg.model.activation_checkpointing:  # around the compiled blocks: recomputes them
        apply_activation_checkpointing(model)
    if world > 1:  # shard from outside the model: FSDP2 over NCCL (GPUs) or gloo (CPUs)
        if mtp is not None:
            broadcast_module(mtp)  # its random parts start alike on every rank
        apply_fsdp(model, bf16=cfg.model.dtype == "bf16")
    evals = eval_batches(data, cfg.eval.batch_size)
    report_path = run_dir / "report.json"
    report: dict[str, Any] = json.loads(report_path.read_text()) if report_path.exists() else {
        "name": cfg.name, "eval_loss": {}, "probe": {}, "stages": {}}
    metrics_path = run_dir / "metrics.jsonl"
    if is_main() and metrics_path.exists():  # steps after a checkpoint run again: logged once
        reached = {s.name: pos.step if (pos := position_of(run_dir / "ckpt" / s.name)) else 0
                   for s in cfg.stages}
        rows = read_metrics(metrics_path)
        keep = [m for m in rows if m["step"] <= reached.get(m["stage"], m["step"])]
        # a last line cut short by a kill (left out of the rows, or whole but for its newline)
        # goes too: the next row would be appended to it
        text = metrics_path.read_text()
        if len(keep) < len(rows) or text.count("\n") != len(rows) or not text.endswith("\n"):
            write_atomic(metrics_path, "".join(json.dumps(m) + "\n" for m in keep))
    metrics_f = metrics_path.open("a") if is_main() else None

    def save_report() -> None:
        if is_main():
            write_atomic(report_path, json.dumps(report, indent=1))

    def held_out_for(si: int) -> Callable[[], dict[str, Any]]:
        """The held-out figures after stage ``si``: the modules, once a stage has trained
        them (a later stage may move the model), on the held-out code and on the model's own
        continuations of it (as it is now: a distillation stage's model does not change)."""
        heads = mtp if 0 <= _first_mtp(cfg) <= si else None
        continued = ([] if heads is None or not cfg.eval.continuations
                     else continue_held_out(model))
        return lambda: evaluate(model, heads, evals, continued)

    def finish(si: int, held_out: Callable[[], dict[str, Any]], losses: list[float]) -> None:
        """A trained stage's entries in the report. Its losses are the logged ones where
        there is a log (a resumed stage's first steps ran in an earlier start)."""
        st = cfg.stages[si]
        figures = held_out()
        report["eval_loss"][st.name] = figures["loss"]
        for key in ("mtp_agree", "mtp_agree_text"):
            if key in figures:
                report.setdefault(key, {})[st.name] = figures[key]
        logged = [m["loss"] for m in read_metrics(metrics_path) if m["stage"] == st.name]
        losses = logged if metrics_f is not None else losses
        report["stages"][st.name] = {"first_loss": losses[0] if losses else None,
                                     "last_loss": losses[-1] if losses else None,
                                     "seq_len": st.seq_len, "steps": st.steps, "mtp": st.mtp}
        if st.probe:
            report["probe"][f"{st.name}/after"] = passkey_probe(
                model, tok, data.probe_filler, probe_len(), cfg.eval.probe_trials, cfg.seed)
        save_report()
        agree = {k: " ".join(f"{a:.3f}" for a in v) for k, v in figures.items()
                 if k.startswith("mtp_agree")}
        console.print(f"eval loss after {st.name}: {figures['loss']:.4f}" + "".join(
            f"; drafts agree {agree[k]} {where}" for k, where in (
                ("mtp_agree", "on its continuations"), ("mtp_agree_text", "on the code"))
            if k in agree))

    def probe_len() -> int:
        return min(cfg.eval.probe_len, model.cfg.max_seq_len)

    if "base" not in report["eval_loss"]:
        report["eval_loss"]["base"] = evaluate(model, None, evals)["loss"]
        save_report()
    console.print(f"eval loss (base): {report['eval_loss']['base']:.4f}")
    for si, st in enumerate(cfg.stages):
        ck = run_dir / "ckpt" / st.name
        pos = position_of(ck)
        if st.rope_scaling is not None:
            set_rope_scaling(model, mtp, st)
        if pos is not None and pos.done:
            load_weights(ck, model, mtp)
            if st.name in report["stages"]:
                console.print(f"stage {st.name}: done (checkpoint), skipping")
            else:  # a stop between its last checkpoint and the report
                console.print(f"stage {st.name}: done (checkpoint), its figures not reported")
                finish(si, held_out_for(si), [])
            continue
        if pos is not None and pos.world not in (None, world):
            # its rows were packed for that many ranks, and the loader's position is in them
            raise ValueError(f"{ck}: stage {st.name!r} was started on {pos.world} processes "
                             f"and goes on only on as many ({world} now): resume the run on "
                             f"{pos.world} processes")
        if st.self_gen is not None:  # by the model as the stage starts, resumed or not
            data.shards["self"] = self_data(cfg, st, model, data, run_dir, console)
        if pos is not None:
            load_weights(ck, model, mtp)
            console.print(f"stage {st.name}: going on from step {pos.step}/{st.steps} "
                          "(checkpoint)")
        feats = stored_hidden(st, data, cfg.model.mtp_taps)
        with main_rank_first():
            packed = stage_packed(cfg, st, si, data, run_dir, world, origins=feats is not None)
        # every rank its own share of the rows, in the same seeded order
        loader = PackedLoader(packed, st.batch_size, seed=cfg.seed + si, rank=rank, world=world,
                              features=feats)
        if st.probe and pos is None:
            report["probe"][f"{st.name}/before"] = passkey_probe(
                model, tok, data.probe_filler, probe_len(), cfg.eval.probe_trials, cfg.seed)
            save_report()  # a resumed stage would not probe its model as it was before
        held_out = held_out_for(si)
        with progress(console, TextColumn(f"[cyan]{st.name}"), BarColumn(),
                      TextColumn("{task.completed}/{task.total} loss {task.fields[loss]}"),
                      TimeElapsedColumn()) as prog:
            task = prog.add_task(st.name, total=st.steps, completed=pos.step if pos else 0,
                                 loss="-")

            def log(m: dict[str, Any], prog: Any = prog, task: Any = task) -> None:
                if metrics_f is not None:
                    metrics_f.write(json.dumps(m) + "\n")
                    metrics_f.flush()
                prog.update(task, completed=m["step"], loss=f"{m['loss']:.3f}")

            losses = train_stage(cfg, si, model, mtp, loader, run_dir,
                                 resume_from=ck if pos is not None else None, log=log,
                                 held_out=held_out, tok=tok)
        finish(si, held_out, losses)
    if metrics_f is not None:
        metrics_f.close()
    final = run_dir / "final"
    full = full_state_dict(model)  # gathered once (a collective under FSDP) for both writes
    save_checkpoint(final, model, model.cfg, mtp, None,  # `dojo serve --model runs/<name>/final`
                    TrainPosition(len(cfg.stages), 0, {}, True), full=full, tokenizer=tok)
    if cfg.export_hf and model.cfg.moe is None:
        hf_dir = run_dir / "hf"
        if is_main():
            from codedojo.model.hf import save_hf

            save_hf(full, model.cfg, hf_dir)
            if mtp is not None:
                save_mtp(mtp, hf_dir)
            tok.save(hf_dir)
        report["hf_export"] = str(hf_dir)
    report["checkpoint"] = str(final)
    save_report()
    barrier()  # every rank returns once rank 0 has written it all
    return report
