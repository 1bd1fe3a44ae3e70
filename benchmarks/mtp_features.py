"""Would the first MTP module draft better if it also read lower layers' states (the fused
features of EAGLE-3, Li et al. 2025) than the main model's last hidden state alone (DeepSeek-V3)?

A paired fine-tune of a checkpoint's MTP modules, all measured in this run. Every variant starts
from the checkpoint's modules and trains on the same self-generated rows (the run's own, as the
`mtp_self` stage trains), in the same order, for the same steps, by the same self-distillation
loss (`distill_loss` toward the main head over the draft vocabulary, bf16 autocast, the model
frozen):
- ``baseline``: the modules as they are, reading the last hidden state h (a checkpoint's own
  tap projections, where its modules read some, left out of every variant: ``start`` measures
  the checkpoint as it is);
- ``fused``: module k reads h^{k-1} + F_k [RMSNorm(h_a); RMSNorm(h_b); ...], h_a the output of
  layer a (0-based) and so on for ``--layers`` (the MTP modules' ``taps``), F_k starting at zero
  (so they start from the baseline's drafts) and trained at ``--fuse-lr``;
- ``control``: a projection of the last hidden state itself (the last layer tapped): new
  weights and no new information. It has the weights of one tapped layer (D x D a module), so
  with ``--layers`` of n layers ``fused`` has n times as many: ``gain_over_control_depth1``
  bounds what the projection's weights alone give, not all that n layers' weights could.
Then each variant's drafts are checked against held-out greedy continuations of the eval
documents (`mtp_agreement.py`'s measure): ``agree_depthK`` is the share of generated tokens
depth K predicts; ``accept_first`` and ``tokens_per_pass`` are those of the rounds greedy
speculative decoding drafting every depth would make over the same text (`replay_greedy`: the
engine's chain rounds, as `spec_decode.py` counts them, without its timing).

On SmolLM2-135M with heads distilled on 12,800 prompts for one pass (2400 rows, 600 steps), the
first depth's agreement rose from 0.720 to 0.732 (baseline), 0.729 (control) and 0.757 reading
layers 8 and 20, the second depth's from 0.715 to 0.723, 0.724 and 0.740; the replayed rounds'
accept_first from 0.685 to 0.703, 0.700 and 0.730 (2.21, 2.21 and 2.27 tokens a pass). With the
first module alone reading the taps, depth 2 reached 0.725. On another draw of rows, layers 3
and 14 gave 0.751 at depth 1, and 3, 8, 14, 20 and 24 gave 0.758, against a baseline of 0.731.
About 25 minutes on 2 CPU cores. Prints one JSON line. ``--save DIR``: the fused variant as a
checkpoint (the main model's files linked, the new modules beside them), for `spec_decode.py`.

    python benchmarks/mtp_features.py [--ckpt runs/cpt-smollm2/final] [--layers 8,20]
                                      [--rows 2400] [--steps 600] [--train DIR] [--save DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from mtp_agreement import (  # benchmarks/
    agreement,
    checkpoint,
    held_out,
    hidden_states,
    newest_self,
    parse_held_out,
    read_by,
)
from torch import nn

from codedojo.data.shards import TokenShards
from codedojo.model.mtp import MTP, distill_loss, save_mtp
from codedojo.model.weights import build_model


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
    ap.add_argument("--fuse-lr", type=float, default=1e-2, help="the projections'")
    ap.add_argument("--save", default=None, help="write the fused variant's checkpoint here")
    args = parse_held_out(ap, prompts=128)
    if args.rows < args.batch * args.steps:
        sys.exit(f"--rows {args.rows}: fewer than --batch x --steps ({args.batch * args.steps}); "
                 "every step reads new rows")

    weights, cfg, mtp0 = checkpoint(Path(args.ckpt))
    model = build_model(weights, cfg, torch.float32).eval().requires_grad_(False)
    layers = [int(x) for x in args.layers.split(",") if x.strip().lstrip("-").isdigit()]
    if (len(layers) != len(args.layers.split(",")) or layers != sorted(set(layers))
            or any(not 0 <= i < cfg.n_layers - 1 for i in layers)):
        sys.exit(f"--layers {args.layers}: increasing layer indexes below the last, of 0 .. "
                 f"{cfg.n_layers - 2}, separated by commas")
    if args.save and Path(args.save).exists():
        sys.exit(f"--save {args.save}: exists; name a new directory")
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
    rows, _ = held_out(model, args.data, args.prompts, args.prompt_len, args.new, args.seed)
    last = cfg.n_layers - 1
    # every tapped layer once, then each variant's columns of them: D wide blocks, the last
    # hidden state first (as `Transformer.hidden` gives them)
    every = sorted({*layers, *mtp0.taps, last})  # the checkpoint's own taps, for "start"
    train_states = hidden_states(model, train, every, bf16=True)  # as the stage trains
    states = hidden_states(model, rows, every, bf16=False)  # as a float32 engine serves
    vocab = mtp0.draft_vocab

    def measure(heads: MTP) -> dict[str, float]:
        """Held-out agreement of each depth, and the acceptance and tokens a pass of the greedy
        rounds drafting every depth would make over the same text (`replay_greedy`)."""
        agree, rounds, _ = agreement(model, heads, rows,
                                     read_by(states, every, heads.taps, cfg.dim), args.prompt_len)
        return {**{f"agree_depth{k}": round(a, 4) for k, a in enumerate(agree, start=1)},
                "accept_first": round(rounds[-1].accept_first, 4),
                "tokens_per_pass": round(rounds[-1].tokens_per_pass, 4)}

    def fine_tune(taps: Sequence[int]) -> MTP:
        """The checkpoint's modules trained on the rows, reading the layers ``taps`` besides
        (their projections new, at zero: those of a checkpoint whose modules read taps of
        their own are left out, so every variant starts from the same drafts)."""
        heads = MTP(cfg, mtp0.depth, 0 if vocab is None else len(vocab), taps,
                    blocks=mtp0.n_blocks)
        own = {n: t for n, t in mtp0.state_dict().items() if ".fuse." not in n}
        missing = heads.load_state_dict(own, strict=False).missing_keys
        assert all(".fuse." in n for n in missing), missing
        heads.train()
        fuse = [p for n, p in heads.named_parameters() if ".fuse." in n]
        groups = [{"params": [p for n, p in heads.named_parameters() if ".fuse." not in n],
                   "peak": args.lr}]
        if fuse:
            groups.append({"params": fuse, "peak": args.fuse_lr})
        opt = torch.optim.AdamW(groups, lr=args.lr, weight_decay=0.0)
        B, T = args.batch, train.shape[1]
        positions, mask = torch.arange(T).expand(B, T), torch.ones(B, T, dtype=torch.bool)
        warmup, decay = 10, max(1, int(0.3 * args.steps))  # warmup-stable-decay, as the stage
        for step in range(args.steps):
            scale = min(1.0, (step + 1) / warmup, (args.steps - step) / decay)
            for g in opt.param_groups:
                g["lr"] = g["peak"] * scale
            tok, s = train[step * B:(step + 1) * B], train_states[step * B:(step + 1) * B]
            with torch.autocast("cpu", torch.bfloat16):
                teacher = model.head(s[..., :cfg.dim], vocab)
                outs = heads(read_by(s, every, taps, cfg.dim), tok, positions, model.embed,
                             detach=True)
                loss = distill_loss([model.head(o, vocab) for o in outs], teacher, mask)
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], 1.0)
            opt.step()
        return heads.eval()

    fused = fine_tune(layers)
    results = {"start": measure(mtp0), "baseline": measure(fine_tune(())),
               "fused": measure(fused),
               "control": measure(fine_tune([last]))}  # the last hidden state, projected again
    if args.save:
        save_fused(Path(args.ckpt), Path(args.save), fused)
    print(json.dumps({
        "bench": "mtp_features",
        **{f"{name}_{k}": v for name, r in results.items() for k, v in r.items()},
        "gain_depth1": round(results["fused"]["agree_depth1"]
                             - results["baseline"]["agree_depth1"], 4),
        "gain_over_control_depth1": round(results["fused"]["agree_depth1"]
                                          - results["control"]["agree_depth1"], 4),
        "layers": layers, "rows": args.rows, "steps": args.steps, "lr": args.lr,
        "fuse_lr": args.fuse_lr, "positions": len(rows) * args.new, "n_mtp": mtp0.depth,
        "ckpt_taps": list(mtp0.taps),
        "ckpt": args.ckpt, "train": str(train_dir), "saved": args.save}))


def save_fused(ckpt: Path, out: Path, heads: MTP) -> None:
    """A checkpoint of ``ckpt``'s main model (its files linked, or copied across file
    systems) with ``heads`` as its MTP modules."""
    out.mkdir(parents=True)
    for f in ckpt.iterdir():
        if f.is_file() and not f.name.startswith("mtp.") and f.name != "trainer.pt":
            try:
                os.link(f, out / f.name)
            except OSError:
                shutil.copy2(f, out / f.name)
    save_mtp(heads, out)


if __name__ == "__main__":
    main()
