"""Speculative decoding with MTP drafts vs plain decoding, batch 1, on held-out code prompts.

The prompts are the held-out files' first tokens (`--prompts` files, in order); with
`--mid-file S`, a share S of them are distinct windows inside the files instead (code
completion mid-way through a file, as the modules' training prompts are half of the time).

Uses the checkpoint `dojo pretrain configs/cpt-smollm2.toml` writes (SmolLM2-135M after CPT, with
MTP modules trained by self-distillation, drafting over its draft vocabulary). Both sides are the
engine `dojo serve` runs, one request at a time, in this process, on the same prompts: plain
(`Engine(model)`) and speculative (`Engine(model, drafter=...)`). Greedy by default, so both must
emit identical tokens (checked; `--temperature`: sampling, unseeded, as the engine speculates
only for an unseeded sampled request, where they draw different tokens and `greedy_identical` is
null). Prints one JSON line; besides the end-to-end
figures (prefill included), `plain_step_ms` / `spec_round_ms` time decoding after each prompt's
first step, and `round_cost_in_steps` says what one step of the speculative engine (a round, or a
plain step once speculation is off) costs in plain steps; `steady_speedup` is the tokens/s ratio
over those steps. `plain_step_ms_range` is the plain step of the fastest and the slowest prompt;
when they differ by more than a quarter, `steady_machine` is false and a warning says so (a shared
VM changes pace between stretches). The engine drafts with every module for its first 64 rounds
(every fourth without drafts, to time a plain step), then as many tokens per round as pay by the
acceptance seen and what a draft costs (`draft_cost`, in plain steps: measured then, or
`--draft-cost`): `drafts_per_round` is the mean (a tree round's depth), `draft_tokens_per_round`
the tokens drafted and verified a round (a tree round's nodes), `accept_depthJ` the acceptance of
draft J when drafts 1..J-1 passed (with `--tree`, of any node at depth J, while `accept_first`
stays the most likely first draft's). Both count rounds, not positions, so they move with the
drafts a round: deeper rounds skip more of the easy stretches (`mtp_agreement.py` replays the
rounds of each depth over held-out continuations); `tokens_per_pass` counts a tree's pass as one,
whatever its nodes. `modelled_speedup` prices the same decode steps by the cost model the engine
chooses a chain's depth by (a step drafting k tokens costs 1 + k * draft_cost plain steps; for a
tree, k is its nodes, as the target verifies every one): with
`--draft-cost` given it depends on the checkpoint and the policy alone, not on this machine's timing
(on a shared 2-core VM the wall-clock speedup of one checkpoint read 1.08 and 1.18 in two runs).
`accept_first_ci95` and `speedup_ci95` are 95% intervals over the files the prompts were cut from
(a bootstrap of files, as windows of one file are alike): how far the figures would move with as
many other prompts of the same kind.

    python benchmarks/spec_decode.py [--ckpt runs/cpt-smollm2/final] [--prompts 24] [--new 64]
                                    [--mid-file 0.5 --seed 123]
                                    [--draft-cost C] [--dtype bfloat16] [--draft-dtype bfloat16]
                                    [--temperature 1.0] [--tree 5]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

# A plain step's time may range this much over the prompts before the run reads as unsteady
# (the prompts' lengths do not differ: the range is the machine's).
STEADY_SPREAD = 1.25


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="runs/cpt-smollm2/final")
    ap.add_argument("--data", default="runs/cpt-smollm2/data/eval")
    ap.add_argument("--prompts", type=int, default=24,
                    help="held-out prompts (with 6, the acceptance of one checkpoint "
                    "read 0.17 in one run and 0.41 with 24)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--mid-file", type=float, default=0.0,
                    help="share of the prompts taken mid-file, at distinct windows of the "
                    "held-out files drawn with --seed, the rest at files' starts (0: each "
                    "held-out file's first tokens, in order, the targets' setting; 0.5: as "
                    "the modules' training prompts are drawn and mtp_agreement.py reads)")
    ap.add_argument("--seed", type=int, default=123, help="the --mid-file windows' draw")
    ap.add_argument("--new", type=int, default=64,
                    help="tokens generated a prompt (64: the targets' setting). The small "
                         "model's greedy text soon repeats itself, which the drafts follow "
                         "easily: of its continuations of held-out code, 0.28 of the first 64 "
                         "tokens end an 8-gram seen earlier in the row, 0.79 of the next 64 and "
                         "0.90 of the 128 after (0.03 in the code as written), and one set of "
                         "heads read accept_first 0.736 and speedup 1.58-1.72 at 64, 0.865 and "
                         "2.00 at 256. Longer runs measure the loops more than the drafts.")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy (the targets' setting, output checked against plain "
                    "decoding); above 0: speculative sampling, unseeded (a seeded request "
                    "decodes plainly), where the two sides draw different tokens and a draft "
                    "passes with probability min(1, p/q)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="weights and KV caches (as dojo serve --dtype)")
    ap.add_argument("--draft-dtype", choices=["float32", "bfloat16"], default=None,
                    help="the MTP drafts' type (as dojo serve --draft-dtype; default: --dtype)")
    ap.add_argument("--tree", type=int, default=None,
                    help="nodes of the greedy rounds' draft tree (the engine's spec_tree, as "
                    "dojo serve --spec-tree: probed against chains, kept if it pays; 0: "
                    "chains; default: the engine's, chains on a CPU)")
    ap.add_argument("--draft-cost", type=float, default=None,
                    help="the engine's spec_draft_cost (default: measured while probing; 0: "
                    "every round drafts with every module)")
    args = ap.parse_args()
    if not 0.0 <= args.mid_file <= 1.0:
        sys.exit(f"--mid-file {args.mid_file}: a share, in [0, 1]")
    torch.set_num_threads(args.threads)

    from decode import TimedRequest, time_request  # benchmarks/decode.py
    from mtp_agreement import require_checkpoint  # benchmarks/

    from codedojo.data.shards import TokenShards
    from codedojo.engine.engine import Engine
    from codedojo.engine.speculative import SpecStats, load_drafter
    from codedojo.engine.types import SamplingParams
    from codedojo.model.weights import load_model
    from codedojo.ops import kernel_status
    from codedojo.pretrain.selfgen import draw_windows
    from codedojo.stats import ratio_interval

    ck = Path(args.ckpt)
    require_checkpoint(ck)
    model, cfg = load_model(ck, dtype=getattr(torch, args.dtype))
    max_len = args.prompt_len + args.new + 16  # + the drafts of the last round
    draft_dtype = args.draft_dtype or args.dtype
    drafter = load_drafter(model, ck, max_len, dtype=getattr(torch, draft_dtype))
    if drafter is None:
        sys.exit(f"{ck}: checkpoint has no MTP modules")
    shards = TokenShards(args.data)
    if args.mid_file:
        try:
            docs, offs = draw_windows(shards, args.prompts, args.prompt_len, args.seed,
                                      doc_start_frac=1.0 - args.mid_file)
        except ValueError as e:
            sys.exit(f"--prompts {args.prompts}, --prompt-len {args.prompt_len}: {e}")
        files = docs.tolist()
        prompts = [shards.doc(d)[o:o + args.prompt_len].tolist()
                   for d, o in zip(files, offs.tolist(), strict=True)]
    else:
        files = [i for i in range(len(shards))
                 if len(shards.doc(i)) >= args.prompt_len][:args.prompts]
        prompts = [shards.doc(i)[:args.prompt_len].tolist() for i in files]
    if not prompts:
        sys.exit(f"{args.data}: no held-out file of --prompt-len {args.prompt_len} tokens or "
                 f"more (--prompts {args.prompts})")
    plain = Engine(model, max_batch=1, max_seq_len=max_len)
    spec = Engine(model, max_batch=1, max_seq_len=max_len, drafter=drafter,
                  spec_draft_cost=args.draft_cost, spec_tree=args.tree)
    for eng in (plain, spec):  # warm-up
        eng.generate([prompts[0][:16]], SamplingParams(max_tokens=4, temperature=0))
    st = spec.spec_stats = SpecStats()  # count the measured prompts only
    runs: dict[str, list[TimedRequest]] = {"plain": [], "spec": []}
    firsts: list[tuple[int, int]] = []  # each prompt's rounds, and those its first draft passed
    for p in prompts:  # alternate, so both sides see the same machine load
        # no seed: the engine decodes a seeded sampled request plainly (a seed must give the
        # same tokens however the drafts went), and a greedy one needs none
        params = SamplingParams(max_tokens=args.new, temperature=args.temperature)
        rounds, top = st.rounds, st.top_first
        for side, eng in (("plain", plain), ("spec", spec)):
            runs[side].append(time_request(eng, p, params))
        firsts.append((st.top_first - top, st.rounds - rounds))
    same = (all(a.token_ids == b.token_ids for a, b in zip(*runs.values(), strict=True))
            if args.temperature == 0 else None)

    def tok_s(side: str) -> float:
        return (sum(len(r.token_ids) for r in runs[side])
                / sum(r.first_s + r.decode_s for r in runs[side]))

    def after_first(side: str) -> tuple[float, float]:  # seconds a step, tokens a second
        rs = runs[side]
        seconds = sum(r.decode_s for r in rs)
        steps = max(1, sum(r.decode_steps for r in rs))
        return seconds / steps, sum(r.decoded for r in rs) / seconds

    # The machine's pace over the run: a shared VM moves between modes (a plain step of 11 ms
    # in one stretch, 14-18 in another). The two sides alternate prompt by prompt, so the
    # speedup sees both alike, but the engine timed its draft cost once, in its first rounds.
    paces = [r.decode_s / r.decode_steps * 1e3 for r in runs["plain"] if r.decode_steps]
    spread = max(paces) / min(paces) if paces else 1.0
    if spread > STEADY_SPREAD:
        print(f"spec_decode: the plain step ranged {min(paces):.1f}-{max(paces):.1f} ms over "
              f"the prompts ({spread:.2f}x): the machine changed pace during the run, so the "
              "draft cost the engine measured and the speedup come from an unsteady machine "
              "(--draft-cost fixes the first)", file=sys.stderr)
    # How far the figures would move with other prompts of the same kind (the spread of the
    # files they were cut from, as several windows of one file are alike): the speedup's where
    # both sides emit the same tokens (greedy), as plain seconds over speculative seconds.
    accept_ci = ratio_interval(*zip(*firsts, strict=True), units=files) if st.rounds else None
    speedup_ci = ratio_interval([r.first_s + r.decode_s for r in runs["plain"]],
                                [r.first_s + r.decode_s for r in runs["spec"]],
                                units=files) if same else None
    # the decode steps and their drafts, a tree's nodes (a first step prefills, samples and runs
    # a round: its drafts are not priced, as its tokens are not counted)
    priced = sum(r.decode_steps + spec.draft_cost * r.decode_drafts for r in runs["spec"])
    modelled = sum(r.decoded for r in runs["spec"]) / priced
    plain_tok_s, spec_tok_s = tok_s("plain"), tok_s("spec")
    plain_step, plain_steady = after_first("plain")
    spec_round, spec_steady = after_first("spec")
    vocab = drafter.mtp.draft_vocab
    print(json.dumps({
        "bench": "spec_decode",
        "accept_first": round(st.accept_first, 4),
        "mean_accepted": round(st.mean_accepted, 4),
        "accept_rate": round(st.accept_rate, 4),
        "tokens_per_pass": round(st.tokens_per_pass, 4),
        "spec_tok_s": round(spec_tok_s, 2), "plain_tok_s": round(plain_tok_s, 2),
        "speedup": round(spec_tok_s / plain_tok_s, 3), "greedy_identical": same,
        # 95% intervals over the prompts' files (a bootstrap: `codedojo.stats.ratio_interval`)
        "accept_first_ci95": accept_ci and [round(x, 4) for x in accept_ci],
        "speedup_ci95": speedup_ci and [round(x, 3) for x in speedup_ci],
        # Without the prompt: a plain step, a speculative round, and what they give.
        "plain_step_ms": round(plain_step * 1e3, 2), "spec_round_ms": round(spec_round * 1e3, 2),
        "plain_step_ms_range": [round(min(paces), 2), round(max(paces), 2)] if paces else None,
        "steady_machine": spread <= STEADY_SPREAD,
        "round_cost_in_steps": round(spec_round / plain_step, 3),
        "steady_speedup": round(spec_steady / plain_steady, 3),
        "modelled_speedup": round(modelled, 4),
        **{k: round(v, 4) for k, v in st.as_dict().items() if k.startswith("accept_depth")},
        "draft_cost": round(spec.draft_cost, 3), "draft_cost_measured": args.draft_cost is None,
        "drafts_per_round": round(st.drafts_per_round, 3),
        "draft_tokens_per_round": round(st.verified / max(1, st.rounds), 3),
        "speculating_at_end": spec.speculating,
        "tree": None if spec.spec_tree is None else len(spec.spec_tree),
        "tree_pays": spec.tree_pays,  # after probing: whether greedy rounds drafted it
        "n_mtp": drafter.depth, "draft_vocab": cfg.vocab_size if vocab is None else len(vocab),
        "mtp_taps": list(drafter.taps), "mtp_blocks": drafter.mtp.n_blocks,
        "prompts": len(prompts), "prompt_len": args.prompt_len, "new_tokens": args.new,
        "mid_file": args.mid_file,
        "batch": 1, "temperature": args.temperature, "dtype": args.dtype,
        "draft_dtype": draft_dtype, "threads": args.threads, "kernel": kernel_status(),
        "ckpt": str(ck)}))


if __name__ == "__main__":
    main()
