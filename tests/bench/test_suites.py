import re
from collections import Counter

import pytest

from codedojo.bench.builder import load_recipe
from codedojo.bench.suite import SUITES_DIR, load_suite


def test_v0_meets_its_specification():
    s = load_suite("v0")
    assert len(s) >= 60
    assert len({t.package for t in s.tasks}) >= 6
    assert len({t.bug_kinds[0] for t in s.tasks if t.category != "feature"}) >= 4
    cats = Counter(t.category for t in s.tasks)
    assert len(set(cats) - {"bugfix"}) >= 2
    train, test = set(s.manifest.splits["train"]), set(s.manifest.splits["test"])
    assert train and test and not train & test and train | test == {t.instance_id for t in s.tasks}
    # held-out split covers every package
    assert {t.package for t in s.split("test")} == {t.package for t in s.tasks}
    for t in s.tasks:
        assert t.FAIL_TO_PASS and t.PASS_TO_PASS
        # a bug's statement never names the file the bug is in (a feature request names its function)
        files = [ln[6:] for ln in t.patch.splitlines() if ln.startswith("--- a/")]
        assert files
        if t.category != "feature":
            for f in files:
                assert not re.search(rf"(?<![\w/]){re.escape(f)}", t.problem_statement), t.instance_id


def test_shipped_recipes_parse():
    assert load_recipe(SUITES_DIR / "v0" / "recipe.toml").name == "v0"
    assert load_recipe(SUITES_DIR / "micro" / "recipe.toml").name == "micro"


@pytest.mark.slow
def test_a_sample_of_v0_validates(provider):
    """One v0 task per category, in sandboxes, from the real sdist (cached after the first run)."""
    import os

    from codedojo.bench.validate import validate_task
    from codedojo.bench.workspace import TaskImages

    s = load_suite("v0")
    sample = [next(t for t in s.tasks if t.category == c and t.package == "inflection")
              for c in ("bugfix", "log-investigation")]
    images = TaskImages(provider)
    old = os.environ.pop("CODEDOJO_CACHE", None)  # the real sdist cache, shared with `dojo demo`
    try:
        for t in sample:
            v = validate_task(images, t, runs=1)
            assert v.ok, v
    finally:
        if old is not None:
            os.environ["CODEDOJO_CACHE"] = old
