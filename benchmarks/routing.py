"""What recording an MoE model's routing costs (``Engine(record_routing=True)``, for router
replay in RL): generation with and without it on the same random MoE model, in this process,
and the size of one completion's routing on the wire (vLLM's base64 NumPy form against JSON
lists of ints).

The model is a small DeepSeek-style MoE (``--layers`` layers, the first dense, ``--experts``
routed experts, top ``--top-k``, one shared expert) with random weights: routing cost does
not depend on what the weights know. ``--batch`` prompts of ``--prompt`` random tokens decode
``--new`` tokens greedily, ``--repeats`` times a side, each side going first in turn; the best
time of each side is kept. Both sides must emit the same tokens (``identical``).

Then an agent-like episode of ``--turns`` calls on one engine with its prefix cache: each prompt
is the last one, its completion and ``--tool`` random tokens of "tool output". Its turns go into
a trajectory (`Trajectory.add_turn`, which keeps the rows a turn adds to the last one's):
``episode_kept_b64_bytes`` against ``episode_whole_b64_bytes``, every turn's rows whole, and
``add_turn_ms`` the time the trajectory took to find and encode them. Prints one JSON line.

    python benchmarks/routing.py [--batch 8] [--prompt 256] [--new 64] [--repeats 3]
                                 [--turns 8] [--tool 96]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from codedojo.engine.engine import Engine
from codedojo.engine.types import Completion, SamplingParams, encode_routed_experts
from codedojo.harness.trajectory import Trajectory, Turn
from codedojo.model.config import ModelConfig, MoEConfig
from codedojo.model.transformer import Transformer


def timed(engine: Engine, prompts: list[list[int]], new: int) -> tuple[float, list[Completion]]:
    t = time.perf_counter()
    out = engine.generate(prompts, SamplingParams(max_tokens=new, temperature=0))
    return time.perf_counter() - t, out


def episode(model: Transformer, args: argparse.Namespace) -> dict[str, float]:
    """One conversation of ``args.turns`` calls; what its routing takes kept whole or shared."""
    engine = Engine(model, max_batch=1, record_routing=True)
    traj = Trajectory(task="bench")
    prompt = torch.randint(0, model.cfg.vocab_size, (args.prompt,)).tolist()
    whole = kept = 0
    add_s = 0.0
    for i in range(args.turns):
        out = engine.generate([prompt], SamplingParams(max_tokens=args.new, temperature=0))[0]
        assert out.routed_experts is not None
        wire = encode_routed_experts(out.routed_experts)
        whole += len(wire)
        turn = Turn(index=i, segment=0, kind="action", message={}, prompt_ids=prompt,
                    completion_ids=out.token_ids, routed_experts=wire)
        t = time.perf_counter()
        traj.add_turn(turn)
        add_s += time.perf_counter() - t
        kept += len(turn.routed_experts or "")
        tool = torch.randint(0, model.cfg.vocab_size, (args.tool,)).tolist()
        prompt = prompt + out.token_ids + tool
    return {"episode_turns": args.turns, "episode_last_prompt": len(prompt) - args.tool,
            "episode_whole_b64_bytes": whole, "episode_kept_b64_bytes": kept,
            "episode_kept_over_whole": round(kept / whole, 4),
            "add_turn_ms": round(add_s * 1e3, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--tool", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    moe = MoEConfig(n_routed_experts=args.experts, top_k=args.top_k, expert_ffn_dim=args.dim // 2,
                    n_shared_experts=1, first_dense_layers=1)
    cfg = ModelConfig.tiny(vocab_size=8192, dim=args.dim, n_layers=args.layers, n_heads=4,
                           n_kv_heads=2, ffn_dim=args.dim * 2, moe=moe,
                           max_seq_len=max(1024, args.prompt + args.turns * (args.new + args.tool)))
    model = Transformer(cfg).eval()
    model.init_weights()
    prompts = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt)).tolist()
    # No prefix cache: every repeat prefills from scratch, on both sides.
    plain = Engine(model, max_batch=args.batch, prefix_cache_tokens=0)
    record = Engine(model, max_batch=args.batch, prefix_cache_tokens=0, record_routing=True)
    timed(plain, prompts[:1], 2)  # warm-up
    best = {"plain": float("inf"), "record": float("inf")}
    outs: dict[str, list[Completion]] = {}
    sides = [("plain", plain), ("record", record)]
    for i in range(args.repeats):
        for name, engine in sides if i % 2 == 0 else sides[::-1]:  # each side first in turn
            s, outs[name] = timed(engine, prompts, args.new)
            best[name] = min(best[name], s)
    tokens = sum(len(c.token_ids) for c in outs["plain"])
    routed = outs["record"][0].routed_experts
    assert routed is not None
    t = time.perf_counter()
    wire = encode_routed_experts(routed)
    encode_ms = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    as_json = json.dumps(routed.tolist())
    json_ms = (time.perf_counter() - t) * 1e3
    print(json.dumps({
        "bench": "routing",
        "moe": {"layers": args.layers, "moe_layers": len(routed[0]), "experts": args.experts,
                "top_k": args.top_k, "dim": args.dim},
        "batch": args.batch, "prompt": args.prompt, "new": args.new,
        "plain_tok_s": round(tokens / best["plain"], 1),
        "record_tok_s": round(tokens / best["record"], 1),
        "record_over_plain": round(best["plain"] / best["record"], 3),
        "identical": [c.token_ids for c in outs["plain"]] == [c.token_ids for c in outs["record"]],
        "rows": len(routed),
        "wire_b64_bytes": len(wire), "wire_json_bytes": len(as_json),
        "encode_ms": round(encode_ms, 2), "json_ms": round(json_ms, 2),
        **episode(model, args),
    }))


if __name__ == "__main__":
    main()
