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


def test_a_text_goes_only_for_a_kept_text_it_nearly_duplicates():
    """A series of edits, each near the one before: every other one stays, and the last,
    unlike every text kept, is not dropped for its likeness to one that was dropped."""
    import random

    from codedojo.data.dedup import DedupConfig, DedupStats, dedup, jaccard
    from codedojo.data.readers import Document

    rng = random.Random(0)
    text = [f"w{i}" for i in range(400)]
    series = []
    for _ in range(5):
        series.append(text)
        text = text[:]
        for j in rng.sample(range(len(text)), 8):
            text[j] = f"x{rng.randrange(10**6)}"
    docs = [Document(" ".join(t), name) for t, name in zip(series, "ABCDE", strict=True)]
    stats = DedupStats()
    kept = [d.source for d in dedup(docs, DedupConfig(), stats)]
    assert kept == ["A", "C", "E"] and stats.near_dupes == 2
    text_of = {d.source: d.text for d in docs}  # each kept one is unlike the one kept before
    for a, b in zip(kept, kept[1:], strict=False):
        assert jaccard(text_of[a], text_of[b]) < 0.8


def test_a_low_threshold_finds_its_near_duplicates():
    """Pairs of Jaccard 0.55-0.65 at a threshold of 0.5: the bands are chosen for it (16 fixed
    bands proposed a fifth of them)."""
    from codedojo.data.dedup import kept_originals

    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(5000)]
    texts: list[str] = []
    while len(texts) < 60:
        a = [rng.choice(vocab) for _ in range(300)]
        b = list(a)
        for i in rng.sample(range(300), 14):
            b[i] = rng.choice(vocab)
        if 0.55 <= jaccard(" ".join(a), " ".join(b)) <= 0.65:
            texts += [" ".join(a), " ".join(b)]
    out = kept_originals(texts, DedupConfig(threshold=0.5))
    assert sum(out[k + 1] == k for k in range(0, 60, 2)) >= 27
    assert all(out[k] == k for k in range(0, 60, 2))  # unlike one another: all kept
