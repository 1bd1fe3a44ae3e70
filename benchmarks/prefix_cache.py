"""Prefix reuse in the engine on SmolLM2-135M-Instruct: an agent-style conversation and a GRPO
group, with the prefix cache and without it (``prefix_cache_tokens=0``), in this process.

- agent: ``--turns`` turns; each sends the whole conversation again (system prompt, then per
  turn a tool output of ``--tool-tokens`` tokens of standard-library source and the model's
  reply), greedy, ``--reply`` tokens a turn. ``agent_s_*`` seconds for all turns; without the
  cache every turn prefills the conversation from its first token. With it the first turn does
  too (checked: ``first_turn_cold``; the cache starts empty, as for a new episode).
- group: ``--group`` requests with one prompt of ``--group-prompt`` tokens, sampled with
  different seeds (a GRPO group); ``group_s_*`` seconds for the group.

Both sides must emit the same tokens (checked: ``identical``). With ``--ckpt`` (a checkpoint
with MTP modules in HF form, as ``dojo pretrain configs/cpt-smollm2.toml`` exports to
runs/cpt-smollm2/hf) the model is that checkpoint's and both engines decode the agent's turns
speculatively (``spec_rounds_*``, ``spec_accept_first_*``: their rounds and first-draft
acceptance on each side). Prints one JSON line.

    python benchmarks/prefix_cache.py [--turns 6] [--tool-tokens 300] [--reply 24]
                                      [--group 8] [--group-prompt 1024] [--threads 2]
                                      [--ckpt runs/cpt-smollm2/hf]
"""

from __future__ import annotations

import argparse
import inspect
import json
import time

import torch

from codedojo.engine.engine import Engine
from codedojo.engine.speculative import load_drafter
from codedojo.engine.types import Completion, SamplingParams
from codedojo.model.tokenizer import load_tokenizer
from codedojo.model.weights import load_model


def agent(engine: Engine, system: list[int], tools: list[list[int]], reply: int
          ) -> tuple[float, list[Completion]]:
    convo, out = list(system), []
    t = time.perf_counter()
    for tool in tools:
        convo += tool
        c = engine.generate([convo], SamplingParams(max_tokens=reply, temperature=0))[0]
        convo += c.token_ids
        out.append(c)
    return time.perf_counter() - t, out


def group(engine: Engine, prompt: list[int], n: int) -> tuple[float, list[Completion]]:
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=s) for s in range(n)]
    t = time.perf_counter()
    out = engine.generate([prompt] * n, params)
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--tool-tokens", type=int, default=300)
    ap.add_argument("--reply", type=int, default=24)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--group-prompt", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ckpt", default=None, help="a checkpoint directory with MTP modules")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model, _ = load_model(args.ckpt) if args.ckpt else load_model()
    tok = load_tokenizer()
    text = "".join(inspect.getsource(m) for m in (inspect, json, argparse))
    ids = tok.encode(text)
    need = args.turns * args.tool_tokens + args.group_prompt + 64
    if len(ids) < need:
        raise SystemExit(f"corpus: {len(ids)} tokens, {need} needed")
    system, ids = ids[:64], ids[64:]
    tools = [ids[i * args.tool_tokens:(i + 1) * args.tool_tokens] for i in range(args.turns)]
    prompt = ids[-args.group_prompt:]

    def drafter():  # one each: a drafter holds the state of the sequence it drafts for
        return load_drafter(model, args.ckpt) if args.ckpt else None

    cached = Engine(model, max_batch=args.group, drafter=drafter())
    fresh = Engine(model, max_batch=args.group, prefix_cache_tokens=0, drafter=drafter())
    for e in (cached, fresh):  # warm-up
        e.generate([system], SamplingParams(max_tokens=2, temperature=0))
    cached.prefix_cache.clear()  # (the first turn starts cold, as a new episode's does)
    agent_cached, a1 = agent(cached, system, tools, args.reply)
    agent_fresh, a2 = agent(fresh, system, tools, args.reply)
    group_fresh, g2 = group(fresh, prompt, args.group)
    group_cached, g1 = group(cached, prompt, args.group)
    identical = all(x.token_ids == y.token_ids for x, y in zip(a1 + g1, a2 + g2, strict=True))
    print(json.dumps({
        "bench": "prefix_cache",
        "agent_s_cached": round(agent_cached, 3), "agent_s_fresh": round(agent_fresh, 3),
        "agent_speedup": round(agent_fresh / agent_cached, 3),
        "agent_prompt_tokens": sum(len(c.prompt_ids) for c in a1),
        "agent_cached_tokens": sum(c.cached_tokens for c in a1),
        "first_turn_cold": a1[0].cached_tokens == 0,
        "group_s_cached": round(group_cached, 3), "group_s_fresh": round(group_fresh, 3),
        "group_speedup": round(group_fresh / group_cached, 3),
        "group_cached_tokens": sum(c.cached_tokens for c in g1),
        "identical": identical,
        **({f"spec_{k}_{side}": getattr(e.spec_stats, k) for k in ("rounds", "accept_first")
            for side, e in (("cached", cached), ("fresh", fresh))} if args.ckpt else {}),
        "turns": args.turns, "tool_tokens": args.tool_tokens,
        "reply_tokens": args.reply, "group": args.group, "group_prompt": args.group_prompt,
        "threads": args.threads, "ckpt": args.ckpt}))


if __name__ == "__main__":
    main()
