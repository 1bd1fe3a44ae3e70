"""How often the MTP drafts agree with the main head's greedy tokens, on held-out code.

`spec_decode.py` sees the acceptance of a few hundred drafts, and it moves with the engine's
choice of how many to draft. This measures the heads alone over many more positions: the model
continues held-out code windows greedily (distinct windows of the eval documents, half of them at
a file's start, as `dojo pretrain` draws its self-generated prompts), then every MTP depth k reads
the model's hidden states and the continuation's real tokens and predicts token i+k+1 at each
position i. `agree_depthK` is the share of the generated tokens it predicts exactly: depth 1's
figure is how often a first draft would pass at a position, depth 2's how often the second would
once the first was right. The baseline, in the same run, is the heads of `--base` (by
default the checkpoint before the last distillation stage) on the same continuations; the two
checkpoints must hold the same main model. `train_agree_depthK` is the same share for our heads
on continuations they were trained on (the run's self-generated data, spread over it): a wide gap
between the two says more distinct prompts would raise the held-out figure, a narrow one that
the modules need more training or capacity. `kK_accept_first` and `kK_tokens_per_pass` replay the
rounds greedy speculative decoding drafting K tokens each would make over the same held-out
continuations (`replay_greedy`): a round's first draft passes less often than `agree_depth1` says
when deep rounds skip the easy stretches they accept, so `spec_decode.py`'s `accept_first` moves
with the number of drafts a round (a three-module checkpoint whose first module agrees 0.768 here
replays 0.764, 0.754 and 0.731 for K = 1, 2, 3). `outside_draft_vocab` is the share of the generated
tokens outside the heads' draft vocabulary, which no draft can be (every depth's agreement is at
most one minus it). `agree_depthK_ci95` is the 95% interval of `agree_depthK` over the files the
prompts were cut from (a bootstrap of files, as windows of one file are alike): how far it would
move with as many other prompts from as many other files. `dojo pretrain` reports the
depths' figure after each stage as `mtp_agree`, on fewer windows (`eval.continuations`). Prints
one JSON line.

    python benchmarks/mtp_agreement.py [--ckpt runs/cpt-smollm2/final]
                                       [--base runs/cpt-smollm2/ckpt/sft] [--prompts 192]
                                       [--train runs/cpt-smollm2/data/self/<stage>-<hash>]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from common import skip  # benchmarks/

from codedojo.data.shards import TokenShards
from codedojo.engine.speculative import SpecStats, replay_greedy
from codedojo.model.config import ModelConfig
from codedojo.model.mtp import MTP, load_mtp
from codedojo.model.transformer import Transformer
from codedojo.model.weights import build_model, load_checkpoint_weights
from codedojo.pretrain.selfgen import continue_windows, draw_windows
from codedojo.stats import ratio_interval


def require_checkpoint(d: Path) -> None:
    """Exits with `common.SKIPPED`, saying what makes one, when ``d`` holds no checkpoint."""
    if not (d / "model.safetensors").exists():
        skip(f"{d}: no checkpoint; run `dojo pretrain configs/cpt-smollm2.toml` first")


def checkpoint(d: Path) -> tuple[dict[str, torch.Tensor], ModelConfig, MTP]:
    """A checkpoint's main weights, config and MTP modules (float32); exits naming what is
    missing."""
    require_checkpoint(d)
    weights, cfg = load_checkpoint_weights(d)
    mtp = load_mtp(d, cfg)
    if mtp is None:
        sys.exit(f"{d}: checkpoint has no MTP modules")
    return weights, cfg, mtp.float().eval()


def parse_held_out(ap: argparse.ArgumentParser, prompts: int) -> argparse.Namespace:
    """Parse ``ap`` with the held-out text's arguments added (`held_out`'s) and the threads
    set."""
    ap.add_argument("--data", default="runs/cpt-smollm2/data/eval")
    ap.add_argument("--prompts", type=int, default=prompts)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--seed", type=int, default=123)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    return args


def held_out(model: Transformer, data: str | Path, prompts: int, prompt_len: int, new: int,
             seed: int) -> tuple[torch.Tensor, list[int]]:
    """(prompts, prompt_len + new): distinct windows of the eval documents, continued greedily
    by ``model`` (the text the drafts will follow when serving); and the document each window
    was cut from."""
    code = TokenShards(data)
    rows = continue_windows(model, code, prompts, prompt_len, new, seed)
    return rows, draw_windows(code, prompts, prompt_len, seed)[0].tolist()


def newest_self(data: str | Path) -> Path | None:
    """The newest self-generated shards beside the run's eval data, or None."""
    written = sorted((Path(data).parent / "self").glob("*/index.json"),
                     key=lambda p: p.stat().st_mtime)
    return written[-1].parent if written else None


def hidden_states(model: Transformer, rows: torch.Tensor, taps: Sequence[int] = (),
                  bf16: bool = False) -> torch.Tensor:
    """(B, T, (1 + len(taps)) D): the last hidden states, the tapped layers' after them
    (`Transformer.hidden`), as MTP modules reading ``taps`` take them; 16 rows a pass."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        return torch.cat([model.hidden(rows[i:i + 16], taps=taps).to(dtype)
                          for i in range(0, len(rows), 16)])


def read_by(states: torch.Tensor, layers: Sequence[int], taps: Sequence[int], dim: int
            ) -> torch.Tensor:
    """What modules reading ``taps`` take of `hidden_states` computed with ``layers`` (which
    hold them): the last states, then the columns of each of the taps."""
    at = [1 + list(layers).index(t) for t in taps]
    return torch.cat([states[..., :dim], *(states[..., i * dim:(i + 1) * dim] for i in at)], -1)


def draft_hits(model: Transformer, heads: MTP, tokens: torch.Tensor, hidden: torch.Tensor
               ) -> list[torch.Tensor]:
    """Whether each depth's greedy draft is the next token: per depth k, (B, T-k-1), row i
    true when the draft read at position i is tokens[i + k + 1]. ``hidden`` is what the modules
    read of the main model (`hidden_states` with their ``taps``)."""
    T = tokens.shape[1]
    drafts = heads.drafts(hidden, tokens, torch.arange(T).expand_as(tokens), model.embed,
                          model.greedy)  # depth k: (B, T-k), row i: token i+k+1
    return [d[:, :T - k - 1] == tokens[:, k + 1:] for k, d in enumerate(drafts, start=1)]


def agreement(model: Transformer, heads: MTP, rows: torch.Tensor, hidden: torch.Tensor,
              prompt_len: int, files: Sequence[int] | None = None
              ) -> tuple[list[float], list[SpecStats], list[list[float]]]:
    """The share of generated tokens (those after the first ``prompt_len``) each depth
    predicts; the rounds greedy speculative decoding drafting k = 1 .. depth tokens each
    would make over these continuations (`replay_greedy`); and per depth the 95% interval of
    the share over the files the rows were cut from (`ratio_interval` by ``files``, each row's:
    how far it would move with other prompts). ``hidden`` as `draft_hits`."""
    B, T = rows.shape
    hits: list[list[int]] = [[] for _ in range(heads.depth)]  # per depth, per row
    seen = [0] * heads.depth  # per depth, a row's positions
    rounds = [SpecStats() for _ in range(heads.depth)]
    for i in range(0, B, 32):
        right = draft_hits(model, heads, rows[i:i + 32], hidden[i:i + 32])
        for k, r in enumerate(right, start=1):
            ok = r[:, prompt_len - k - 1:]
            hits[k - 1] += ok.sum(1).tolist()
            seen[k - 1] = ok.shape[1]
        for b in range(len(right[0])):
            row = [r[b].tolist() for r in right]
            for k, stats in enumerate(rounds, start=1):
                replay_greedy(row, prompt_len, T, k, stats)
    shares = [sum(h) / (n * B) for h, n in zip(hits, seen, strict=True)]
    spread = [list(ratio_interval(h, [n] * B, units=files))
              for h, n in zip(hits, seen, strict=True)]
    return shares, rounds, spread


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="runs/cpt-smollm2/final")
    ap.add_argument("--base", default="runs/cpt-smollm2/ckpt/sft")
    ap.add_argument("--train", default=None,
                    help="self-generated shards the heads trained on (default: the newest under "
                    "the run's data/self; none there: no train_agree figures)")
    args = parse_held_out(ap, prompts=192)

    weights, cfg, mtp = checkpoint(Path(args.ckpt))
    if args.prompt_len <= mtp.depth:  # depth k's first generated target needs k + 1 before it
        sys.exit(f"--prompt-len {args.prompt_len}: must be above the {mtp.depth} MTP depths")
    base_weights, _, base_mtp = checkpoint(Path(args.base))
    if weights.keys() != base_weights.keys() or any(
            not torch.equal(weights[k], base_weights[k]) for k in weights):
        sys.exit(f"{args.base}: its main model differs from {args.ckpt}'s; the baseline heads "
                 "must read the same hidden states")
    model: Transformer = build_model(weights, cfg, torch.float32).eval()

    rows, files = held_out(model, args.data, args.prompts, args.prompt_len, args.new, args.seed)
    layers = sorted({*mtp.taps, *base_mtp.taps})  # one pass serves both sets of heads
    states = hidden_states(model, rows, layers)
    (ours, replayed, spread), (base, _, _) = [
        agreement(model, heads, rows, read_by(states, layers, heads.taps, cfg.dim),
                  args.prompt_len, files)
        for heads in (mtp, base_mtp)]
    generated = rows[:, args.prompt_len:]
    outside = (0.0 if mtp.draft_vocab is None
               else float((~torch.isin(generated, mtp.draft_vocab)).float().mean()))
    train: list[float] = []
    train_dir = Path(args.train) if args.train else newest_self(args.data)
    if train_dir is not None:
        shards = TokenShards(train_dir)
        lens = shards.doc_lengths()
        if (lens != args.prompt_len + args.new).any():
            sys.exit(f"{shards.dir}: its rows are not {args.prompt_len} + {args.new} tokens long "
                     "(--prompt-len, --new)")
        picks = torch.linspace(0, len(lens) - 1, min(len(lens), args.prompts)).long().tolist()
        train_rows = torch.stack([torch.from_numpy(shards.doc(i).astype("int64"))
                                  for i in picks])
        train, _, _ = agreement(model, mtp, train_rows, hidden_states(model, train_rows, mtp.taps),
                             args.prompt_len)
    print(json.dumps({
        "bench": "mtp_agreement",
        **{f"agree_depth{k}": round(a, 4) for k, a in enumerate(ours, start=1)},
        **{f"agree_depth{k}_ci95": [round(x, 4) for x in ci]
           for k, ci in enumerate(spread, start=1)},
        **{f"base_agree_depth{k}": round(a, 4) for k, a in enumerate(base, start=1)},
        **{f"train_agree_depth{k}": round(a, 4) for k, a in enumerate(train, start=1)},
        **{f"k{k}_{name}": round(getattr(st, name), 4) for k, st in enumerate(replayed, start=1)
           for name in ("accept_first", "tokens_per_pass")},
        "outside_draft_vocab": round(outside, 4),
        "positions": len(rows) * args.new, "prompts": len(rows), "prompt_len": args.prompt_len,
        "new_tokens": args.new, "n_mtp": mtp.depth, "ckpt": args.ckpt, "base": args.base}))


if __name__ == "__main__":
    main()
