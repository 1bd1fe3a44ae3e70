from __future__ import annotations

import random
from collections import Counter

from codedojo.data.dedup import DedupConfig, DedupStats, MinHasher, dedup, jaccard, shingles
from codedojo.data.filters import FilterConfig, apply_filters
from codedojo.data.readers import Document


def _code(seed: int, n: int = 60) -> str:
    r = random.Random(seed)
    return "\n".join(f"def f{r.randint(0, 10**6)}(x):\n    return x * {r.randint(0, 999)} + {i}"
                     for i in range(n))


def test_minhash_estimates_jaccard():
    a = _code(1)
    lines = a.splitlines()
    b = "\n".join(lines[:100] + ["# edited"] + lines[100:110])
    h = MinHasher(256)
    est = float((h.signature(shingles(a, 5)) == h.signature(shingles(b, 5))).mean())
    assert abs(est - jaccard(a, b)) < 0.1


def test_dedup_exact_and_near():
    base = _code(7)
    near = base.replace("return x * ", "return x *  ", 1) + "\n# trailing comment"
    spaced = base.replace("\n", "   \n", 2) + "\n\n"  # trailing spaces, blank lines: the same
    docs = [Document(base, "a"), Document(_code(8), "b"), Document(spaced, "c"),
            Document(near, "d"), Document(_code(9), "e")]
    stats = DedupStats()
    kept = [d.source for d in dedup(docs, DedupConfig(threshold=0.7), stats)]
    assert kept == ["a", "b", "e"]
    assert (stats.exact_dupes, stats.near_dupes) == (1, 1)
    only_exact = [d.source for d in dedup(docs, DedupConfig(near=False))]
    assert only_exact == ["a", "b", "d", "e"]
    # indentation is part of a program: h() inside the if or after it are two programs
    inside, after = "if x:\n    g()\n    h()\n", "if x:\n    g()\nh()\n"
    both = dedup([Document(inside, "in"), Document(after, "out")], DedupConfig(near=False))
    assert [d.source for d in both] == ["in", "out"]


def test_filters_report_reasons():
    docs = [Document("x = 1\n" * 30, "ok"), Document("x", "short"),
            Document("a" * 2000 + "\n" + "b = 1\n" * 20, "long_line"),
            Document("# Auto-generated file, do not edit\n" + "x = 1\n" * 30, "gen"),
            Document("{}[]();\n" * 40, "symbols")]
    rejected: Counter[str] = Counter()
    kept = [d.source for d in apply_filters(docs, FilterConfig(), rejected)]
    assert kept == ["ok"]
    assert rejected == Counter(too_short=1, long_line=1, generated=1, alnum_frac=1)
