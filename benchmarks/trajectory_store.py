"""Storing a long agent episode: every turn whole (format 2) against each turn's new tokens
(format 3: the prompt after what it shares with the turn before, the loss mask as run lengths),
measured in the same run on the same episode; and what a trainer runs forward over.

The episode: ``--turns`` model calls; the first prompt is ``--system`` tokens, and each later one
is the one before plus its completion (``--reply`` tokens) and a tool output (``--tool`` tokens),
as the agent loop sends it. ``bytes_whole`` / ``bytes_shared``: the JSONL step log's size both
ways, both holding the same records (checked: ``same_records``); ``write_ms_*`` the time to
write it (the median of ``--reps`` writes, after one untimed write each way that pays the
writers' one-off costs, such as a lazy import), ``read_ms_*`` to read each back (checked to give
the same turns). ``train_tokens_per_turn`` / ``train_tokens_merged``: the tokens a trainer runs
forward over, every turn whole against `training_sequences` (the turns merged into one sequence
where each prompt continues the turn before). Prints one JSON line.

    python benchmarks/trajectory_store.py [--turns 40] [--system 1500] [--reply 150] [--tool 600]
                                          [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from codedojo.harness.sequences import training_sequences
from codedojo.harness.trajectory import Trajectory, TrajectoryWriter, Turn, read_jsonl


def episode(turns: int, system: int, reply: int, tool: int, seed: int = 0) -> Trajectory:
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(49152) for _ in range(n)]

    t = Trajectory(task="benchmark")
    t.messages = [{"role": "user", "content": "fix the bug"}]
    prompt = ids(system)
    for i in range(turns):
        completion = ids(reply)
        t.turns.append(Turn(index=i, segment=0, kind="action",
                            message={"role": "assistant", "content": ""},
                            prompt_ids=list(prompt), completion_ids=completion,
                            logprobs=[-rng.random() for _ in completion],
                            loss_mask=[0] * len(prompt) + [1] * len(completion)))
        prompt = prompt + completion + ids(tool)
    return t


def write_whole(t: Trajectory, path: Path) -> None:
    """Format 2's step log: the header, then every turn as it is in memory, the messages and the
    end (the records `TrajectoryWriter` writes), each line flushed to disk as it does."""
    messages = {"type": "messages", "start": 0, "messages": t.messages, "segments": t.segments}
    with path.open("w", encoding="utf-8") as fh:
        for rec in [{**t.header(), "format": 2},
                    *({"type": "turn", "turn": asdict(turn)} for turn in t.turns), messages,
                    t.end()]:
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
            fh.flush()
            os.fsync(fh.fileno())


def write_shared(t: Trajectory, path: Path) -> None:
    w = TrajectoryWriter(path)
    w.start(t)
    w.finish(t)


def timed_ms(fn: object, *args: object) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*args)  # type: ignore[operator]
    return (time.perf_counter() - t0) * 1e3, out


def write_ms(write: object, t: Trajectory, path: Path, reps: int) -> float:
    """The median time of ``reps`` writes of ``t`` to ``path``, after one untimed write (a
    writer's first call pays one-off costs; each write waits on its own fsyncs)."""
    write(t, path)  # type: ignore[operator]
    return statistics.median(timed_ms(write, t, path)[0] for _ in range(reps))


def record_types(path: Path) -> list[str]:
    return [json.loads(line)["type"] for line in path.read_text(encoding="utf-8").splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--system", type=int, default=1500)
    ap.add_argument("--reply", type=int, default=150)
    ap.add_argument("--tool", type=int, default=600)
    ap.add_argument("--reps", type=int, default=5, help="timed writes each way (the median)")
    args = ap.parse_args()
    if args.reps < 1:
        ap.error(f"--reps {args.reps}: at least one write to time")
    t = episode(args.turns, args.system, args.reply, args.tool)
    with tempfile.TemporaryDirectory() as d:
        whole, shared = Path(d) / "whole.jsonl", Path(d) / "shared.jsonl"
        write_whole_ms = write_ms(write_whole, t, whole, args.reps)
        write_shared_ms = write_ms(write_shared, t, shared, args.reps)
        read_whole_ms, old = timed_ms(read_jsonl, whole)
        read_shared_ms, new = timed_ms(read_jsonl, shared)
        same = old.turns == t.turns and new.turns == t.turns  # type: ignore[attr-defined]
        merged = training_sequences(t)
        print(json.dumps({
            "bench": "trajectory_store", "turns": args.turns,
            "last_prompt_tokens": len(t.turns[-1].prompt_ids),
            "prompt_tokens_all_turns": sum(len(u.prompt_ids) for u in t.turns),
            "bytes_whole": whole.stat().st_size, "bytes_shared": shared.stat().st_size,
            "ratio": round(whole.stat().st_size / shared.stat().st_size, 2),
            "write_ms_whole": round(write_whole_ms, 1), "write_ms_shared": round(write_shared_ms, 1),
            "read_ms_whole": round(read_whole_ms, 1), "read_ms_shared": round(read_shared_ms, 1),
            "same_turns": same, "same_records": record_types(whole) == record_types(shared),
            "reps": args.reps,
            "train_tokens_per_turn": sum(len(u.prompt_ids) + len(u.completion_ids) for u in t.turns),
            "train_tokens_merged": sum(len(q.token_ids) for q in merged),
            "sequences": len(merged),
        }))


if __name__ == "__main__":
    main()
