"""The server's stop-string check per generated token, with long stop strings against short.

Prints one JSON line:
  us_per_token_long    16 stop strings of 2,001 characters ("z" * 2000 and a hex digit), over a
                       1,000-token answer of "z" that never completes one (the worst case: each
                       token extends a start of every stop, and all the text so far is held back)
  us_per_token_short   the baseline measured in the same run: 16 stop strings of 5 characters
  ratio                long / short (the check holds a state per stop: near 1, whatever the length)
  held_chars_*         the characters held back at the answer's end (more than 0: each stop was
                       started and never ended)
Run: python benchmarks/stop_strings.py [--tokens 1000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import time


def per_token_us(stops: list[str], ids: list[int], rounds: int) -> tuple[float, int]:
    """The best round's microseconds a token, and the characters held back before `finish`."""
    from codedojo.engine.server import TextAssembler
    from codedojo.model.tokenizer import tiny_tokenizer

    tok = tiny_tokenizer()
    best, held = float("inf"), 0
    for _ in range(rounds):
        asm = TextAssembler(tok, stops, [], True)
        t0 = time.perf_counter()
        for i in ids:
            asm.push(i)
        held = len(asm.text) - asm.released
        asm.finish()
        best = min(best, time.perf_counter() - t0)
    return 1e6 * best / len(ids), held


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from codedojo.model.tokenizer import tiny_tokenizer

    if args.tokens < 1 or args.rounds < 1:
        ap.error(f"--tokens {args.tokens}, --rounds {args.rounds}: each must be at least 1")
    ids = tiny_tokenizer().encode("z") * args.tokens  # (one token a "z")
    long, held_long = per_token_us(["z" * 2000 + f"{i:x}" for i in range(16)], ids, args.rounds)
    short, held_short = per_token_us(["zzzz" + f"{i:x}" for i in range(16)], ids, args.rounds)
    print(json.dumps({"bench": "stop_strings", "us_per_token_long": round(long, 2),
                      "us_per_token_short": round(short, 2),
                      "ratio": round(long / short, 3), "tokens": args.tokens,
                      "held_chars_long": held_long, "held_chars_short": held_short}))


if __name__ == "__main__":
    main()
