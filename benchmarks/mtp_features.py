"""Would the first MTP module draft better if it also read lower layers' states (the fused
features of EAGLE-3, Li et al. 2025) than the main model's last hidden state alone (DeepSeek-V3)?

A paired fine-tune of a checkpoint's MTP modules, all measured in this run. Every variant starts
from the checkpoint's modules and trains on the same self-generated rows (the run's own, as the
`mtp_self` stage trains), in the same order, for the same steps, by the same self-distillation
loss (`distill_loss` toward the main head over the draft vocabulary, bf16 autocast, the model
frozen):
- ``baseline``: the modules as they are, reading the last hidden state h;
- ``fused``: the first module reads h + W [RMSNorm(h_a); RMSNorm(h_b); ...], h_a the output of
  layer a (0-based) and so on for ``--layers``, W starting at zero (so it starts from the
  baseline's drafts) and trained at ``--fuse-lr``;
- ``control``: the same projection of the last hidden state itself: as many new weights and no
  new information, so a gain of ``fused`` over it is the lower layers' information, not their
  parameters.
Then each variant's drafts are checked against held-out greedy continuations of the eval
documents (`mtp_agreement.py`'s measure): ``agree_depthK`` is the share of generated tokens
depth K predicts; ``accept_first`` and ``tokens_per_pass`` are those of the rounds greedy
speculative decoding drafting every depth would make over the same text (`replay_greedy`: the
engine's chain rounds, as `spec_decode.py` counts them, without its timing).

On SmolLM2-135M with heads distilled on 12,800 prompts for one pass (2400 rows, 600 steps), the
first depth's agreement rose from 0.720 to 0.732 (baseline), 0.730 (control) and 0.757 reading
layers 8 and 20; the replayed rounds' accept_first from 0.685 to 0.703, 0.700 and 0.729 (2.21,
2.20 and 2.25 tokens a pass). On another draw of rows, layers 3 and 14 gave 0.751, and 3, 8, 14,
20 and 24 gave 0.758, against a baseline of 0.731. About 20 minutes on 2 CPU cores. Prints one
JSON line.

    python benchmarks/mtp_features.py [--ckpt runs/cpt-smollm2/final] [--layers 8,20]
                                      [--rows 2400] [--steps 600] [--train DIR]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from mtp_agreement import (  # benchmarks/
    agreement,
    checkpoint,
    held_out,
    layer_states,
    newest_self,
    parse_held_out,
)
from torch import nn

from codedojo.data.shards import TokenShards
from codedojo.model.mtp import MTP, distill_loss
from codedojo.model.weights import build_model


class Fused(nn.Module):
    """h + W [RMSNorm(h_l) for the tapped layers l], W (D, n D) starting at zero."""

    def __init__(self, dim: int, taps: int) -> None:
        super().__init__()
        self.proj = nn.Linear(taps * dim, dim, bias=False)
        nn.init.zeros_(self.proj.weight)

    def forward(self, h: torch.Tensor, taps: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat([F.rms_norm(t.float(), (t.shape[-1],)) for t in taps], -1)
        return h + self.proj(x.to(h.dtype))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="runs/cpt-smollm2/final")
    ap.add_argument("--train", default=None,
                    help="self-generated shards to train on (default: the newest under the "
                    "run's data/self)")
    ap.add_argument("--layers", default="8,20", help="the layers the fused variant reads")
    ap.add_argument("--rows", type=int, default=2400)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3, help="the modules' peak learning rate")
    ap.add_argument("--fuse-lr", type=float, default=1e-2, help="the projection's")
    args = parse_held_out(ap, prompts=128)
    if args.rows < args.batch * args.steps:
        sys.exit(f"--rows {args.rows}: fewer than --batch x --steps ({args.batch * args.steps}); "
                 "every step reads new rows")

    weights, cfg, mtp0 = checkpoint(Path(args.ckpt))
    model = build_model(weights, cfg, torch.float32).eval().requires_grad_(False)
    layers = [int(x) for x in args.layers.split(",") if x.strip().lstrip("-").isdigit()]
    if (len(layers) != len(args.layers.split(",")) or len(set(layers)) != len(layers)
            or any(not 0 <= i < cfg.n_layers - 1 for i in layers)):
        sys.exit(f"--layers {args.layers}: distinct layer indexes below the last, of 0 .. "
                 f"{cfg.n_layers - 2}, separated by commas")
    train_dir = Path(args.train) if args.train else newest_self(args.data)
    if train_dir is None:
        sys.exit(f"{args.data}: no self-generated shards beside it; pass --train")
    shards = TokenShards(train_dir)
    if len(shards) < args.rows:
        sys.exit(f"{train_dir}: {len(shards)} rows, --rows asks for {args.rows}")
    gen = torch.Generator().manual_seed(args.seed)
    picks = torch.randperm(len(shards), generator=gen)[:args.rows].tolist()
    if len(set(shards.doc_lengths()[picks].tolist())) > 1:
        sys.exit(f"{train_dir}: rows of several lengths; self-generated rows (prompt and "
                 "continuation, one length) expected")
    train = torch.stack([torch.from_numpy(shards.doc(i).astype("int64")) for i in picks])
    train_states = layer_states(model, train, layers, bf16=True)  # as the stage trains
    rows = held_out(model, args.data, args.prompts, args.prompt_len, args.new, args.seed)
    states = layer_states(model, rows, layers, bf16=False)  # as a float32 engine serves
    vocab = mtp0.draft_vocab

    def measure(heads: MTP, fuse: Fused | None = None, taps: Sequence[int] = ()
                ) -> dict[str, float]:
        """Held-out agreement of each depth, and the acceptance and tokens a pass of the greedy
        rounds drafting every depth would make over the same text (`replay_greedy`)."""
        with torch.no_grad():
            h = states[-1] if fuse is None else fuse(states[-1], [states[j] for j in taps])
        agree, rounds = agreement(model, heads, rows, h, args.prompt_len)
        return {**{f"agree_depth{k}": round(a, 4) for k, a in enumerate(agree, start=1)},
                "accept_first": round(rounds[-1].accept_first, 4),
                "tokens_per_pass": round(rounds[-1].tokens_per_pass, 4)}

    def fine_tune(taps: list[int] | None) -> dict[str, float]:
        """The checkpoint's modules trained on the rows, with a projection of the states
        ``taps`` (indexes into the stacked states) added to h, or without one (None)."""
        heads = copy.deepcopy(mtp0).train()
        fuse = None if taps is None else Fused(cfg.dim, len(taps))
        groups = [{"params": list(heads.parameters()), "peak": args.lr}]
        if fuse is not None:
            groups.append({"params": list(fuse.parameters()), "peak": args.fuse_lr})
        opt = torch.optim.AdamW(groups, lr=args.lr, weight_decay=0.0)
        B, T = args.batch, train.shape[1]
        positions, mask = torch.arange(T).expand(B, T), torch.ones(B, T, dtype=torch.bool)
        warmup, decay = 10, max(1, int(0.3 * args.steps))  # warmup-stable-decay, as the stage
        for step in range(args.steps):
            scale = min(1.0, (step + 1) / warmup, (args.steps - step) / decay)
            for g in opt.param_groups:
                g["lr"] = g["peak"] * scale
            tok, s = train[step * B:(step + 1) * B], train_states[:, step * B:(step + 1) * B]
            with torch.autocast("cpu", torch.bfloat16):
                teacher = model.head(s[-1], vocab)
                h = s[-1] if fuse is None else fuse(s[-1], [s[j] for j in taps or []])
                outs = heads(h, tok, positions, model.embed, detach=True)
                loss = distill_loss([model.head(o, vocab) for o in outs], teacher, mask)
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], 1.0)
            opt.step()
        return measure(heads.eval(), fuse, taps or [])

    results = {"start": measure(mtp0), "baseline": fine_tune(None),
               "fused": fine_tune(list(range(len(layers)))),
               "control": fine_tune([len(layers)])}  # the last hidden state, projected again
    print(json.dumps({
        **{f"{name}_{k}": v for name, r in results.items() for k, v in r.items()},
        "gain_depth1": round(results["fused"]["agree_depth1"]
                             - results["baseline"]["agree_depth1"], 4),
        "gain_over_control_depth1": round(results["fused"]["agree_depth1"]
                                          - results["control"]["agree_depth1"], 4),
        "layers": layers, "rows": args.rows, "steps": args.steps, "lr": args.lr,
        "fuse_lr": args.fuse_lr, "positions": len(rows) * args.new, "n_mtp": mtp0.depth,
        "ckpt": args.ckpt, "train": str(train_dir)}))


if __name__ == "__main__":
    main()
