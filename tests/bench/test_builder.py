import json
import re

import pytest

from codedojo.bench.patching import apply_patch_to_dir
from codedojo.bench.source import fetch_sdist, find_test_paths, unpack
from codedojo.bench.suite import load_suite


def test_fixture_suite_has_every_category_with_valid_tests(tiny_suite):
    cats = sorted(t.category for t in tiny_suite.tasks)
    assert cats == ["bugfix", "feature", "log-investigation"]
    for t in tiny_suite.tasks:
        assert t.FAIL_TO_PASS and t.PASS_TO_PASS
        assert not set(t.FAIL_TO_PASS) & set(t.PASS_TO_PASS)
        assert t.hidden_paths == ["tests"]
        assert t.base == "tinycalc==0.1.0" and len(t.base_sha256) == 64
        assert t.environment and t.environment[0] == f"pytest=={pytest.__version__}"
        # what the recipe fixes, and a time limit in whole minutes: built again, the same task
        assert t.created_at.isoformat() == "2026-01-02T03:04:05+00:00"
        assert t.timeouts.test_s >= 60 and t.timeouts.test_s % 60 == 0
    splits = tiny_suite.manifest.splits
    assert sorted(splits["train"] + splits["test"]) == sorted(t.instance_id for t in tiny_suite.tasks)
    # the saved suite loads back with its hashes intact
    assert len(load_suite(tiny_suite.path)) == 3


def test_a_recipe_out_of_range_is_named_by_its_field():
    from codedojo.bench.builder import BuildRecipe

    base = {"name": "t", "version": "0.1", "packages": [{"requirement": "tinycalc==0.1.0"}]}
    for bad, field in (({"runs": 0}, "runs"), ({"max_p2p": 0}, "max_p2p"),
                       ({"packages": [{"requirement": "tinycalc>=0.1"}]}, "requirement"),
                       ({"packages": [{"requirement": "tinycalc==0.1.0", "bugfix": -3}]},
                        "bugfix")):
        with pytest.raises(ValueError, match=field):
            BuildRecipe.model_validate({**base, **bad})


def test_bug_patch_and_gold_patch_invert_each_other(tiny_suite, tmp_path):
    tree = unpack(fetch_sdist("tinycalc==0.1.0"))
    original = (tree / "tinycalc/core.py").read_text()
    for t in tiny_suite.tasks:
        work = tmp_path / t.instance_id
        work.mkdir()
        (work / "tinycalc").mkdir()
        (work / "tinycalc/core.py").write_text(original)
        apply_patch_to_dir(t.bug_patch, work)
        assert (work / "tinycalc/core.py").read_text() != original
        apply_patch_to_dir(t.patch, work)
        assert (work / "tinycalc/core.py").read_text() == original


def test_statements_give_symptoms_not_locations(tiny_suite):
    for t in tiny_suite.tasks:
        s = t.problem_statement
        if t.category == "feature":
            assert "NotImplementedError" in s and "tinycalc.core." in s
            continue
        assert "tinycalc/core.py" not in s and not re.search(r"(?<![\w/])core\.py", s)
        removed = [ln[1:].strip() for ln in t.patch.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
        for line in removed:
            assert line not in s, f"{t.instance_id} statement shows the fixed line {line!r}"
        if t.category == "log-investigation":
            logs = [json.loads(ln) for ln in s.split("```jsonl\n")[1].split("\n```")[0].splitlines()]
            errors = [r for r in logs if r["level"] == "ERROR"]
            assert {r["scenario"] for r in errors} == set(t.FAIL_TO_PASS)
            assert len(logs) > len(errors)
        else:
            assert any(f.split("::")[-1] in s for f in t.FAIL_TO_PASS)


def test_fixture_sdist_is_found_in_cache_and_tests_located(bench_cache):
    sd = fetch_sdist("tinycalc==0.1.0")
    assert sd.archive.parent == bench_cache / "bench" / "sdists" / "tinycalc-0.1.0"
    assert find_test_paths(unpack(sd)) == ["tests"]
    with pytest.raises(RuntimeError, match="sha256"):
        fetch_sdist("tinycalc==0.1.0", expect_sha256="f" * 64)
    with pytest.raises(ValueError, match="pinned"):
        fetch_sdist("tinycalc")


@pytest.mark.slow
def test_real_package_from_the_registry(tmp_path):
    """inflection's sdist from PyPI (cached under the user's bench cache) yields a valid task."""
    import os

    from codedojo.bench.builder import BuildRecipe, build_suite

    old = os.environ.pop("CODEDOJO_CACHE", None)  # the real cache, shared with `dojo demo`
    try:
        recipe = BuildRecipe.model_validate({
            "name": "real", "version": "0", "seed": 1, "max_p2p": 5,
            "packages": [{"requirement": "inflection==0.5.1", "bugfix": 1, "feature": 0,
                          "log_investigation": 0, "max_candidates": 15}],
        })
        suite = build_suite(recipe, tmp_path, log=lambda m: None)
    finally:
        if old is not None:
            os.environ["CODEDOJO_CACHE"] = old
    (task,) = suite.tasks
    assert task.repo == "pypi/inflection" and task.FAIL_TO_PASS and task.PASS_TO_PASS
    assert "test_inflection.py" in task.hidden_paths


def test_scrub_removes_build_outputs_but_not_a_package_of_that_name(tmp_path):
    from codedojo.bench.source import scrub

    for rel in ("build/lib/x.py", "dist/x.whl", "pkg/build/__init__.py", "pkg/dist/__init__.py",
                "ns/build/tool.py", "pkg/__pycache__/m.pyc", "pkg/m.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    scrub(tmp_path)
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == ["ns/build/tool.py", "pkg/build/__init__.py", "pkg/dist/__init__.py",
                    "pkg/m.py"]  # (a namespace package's build/ too)


def test_a_failure_message_names_no_file_or_line():
    from codedojo.bench.statement import clean_message

    assert clean_message("cannot import name 'x' from 'pkg.core' (/tmp/work/pkg/core.py)") == \
        "cannot import name 'x' from 'pkg.core' (<source>)"
    assert clean_message("pkg/core.py:41: in clamp") == "<source>: in clamp"
    assert clean_message('File "pkg/core.py", line 12, in f') == 'File "<source>", in f'
    assert clean_message("ValueError: bad value 3.5") == "ValueError: bad value 3.5"


def test_a_failure_message_is_the_same_text_each_run():
    """An object's address in a repr differs between runs; a statement shows none."""
    from codedojo.bench.statement import clean_message

    assert clean_message("assert <function f.<locals>.g at 0x7f3b87297ce0> is None") == \
        "assert <function f.<locals>.g at 0x...> is None"
    assert clean_message("expected 0x1F, got 0x20") == "expected 0x1F, got 0x20"  # (values)


def test_a_feature_statement_keeps_the_quotes_that_end_its_documentation():
    from codedojo.bench.statement import feature_statement

    doc = "Quote a name.\n\n    >>> quote('a')\n    'a'"
    assert feature_statement("m", "quote", "(s)", doc).endswith("\n    'a'\n")


def test_a_recipe_names_each_package_once_and_folders_plainly():
    from codedojo.bench.builder import BuildRecipe, PackageRecipe

    with pytest.raises(ValueError, match=r"each package once: \['tinycalc'\]"):
        BuildRecipe.model_validate({"name": "s", "version": "1", "packages": [
            {"requirement": "tinycalc==0.1.0"}, {"requirement": "TinyCalc==0.2.0"}]})
    for other in ("Dot_Pkg==1.0", "dot-pkg==2.0", "dot..pkg==1.0"):  # (PEP 503: one package)
        with pytest.raises(ValueError, match=r"each package once: \['dot-pkg'\]"):
            BuildRecipe.model_validate({"name": "s", "version": "1", "packages": [
                {"requirement": "dot.pkg==1.0"}, {"requirement": other}]})
    assert PackageRecipe(requirement="a==1", python_path=["./src"]).python_path == ["src"]
    with pytest.raises(ValueError, match="paths inside the sdist"):
        PackageRecipe(requirement="a==1", python_path=["../x"])


def test_a_package_that_fails_to_prepare_is_dropped_and_leaves_no_scratch(tmp_path, monkeypatch):
    import tempfile
    from types import SimpleNamespace

    from codedojo.bench import builder

    tree = tmp_path / "tree"
    (tree / "tests").mkdir(parents=True)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setattr(builder, "fetch_sdist", lambda req: SimpleNamespace(name=req))
    monkeypatch.setattr(builder, "unpack", lambda sdist: tree)
    monkeypatch.setattr(builder, "_baseline", lambda *a: (_ for _ in ()).throw(
        RuntimeError("pip download failed")))
    logged: list[str] = []
    recipe = builder.BuildRecipe.model_validate({"name": "s", "version": "1", "packages": [
        {"requirement": "a==1"}, {"requirement": "b==1"}]})
    with pytest.raises(builder.BuildError, match="produced no task"):  # each dropped, in turn
        builder.build_suite(recipe, tmp_path / "out", log=logged.append)
    assert sum("package dropped: RuntimeError: pip download failed" in m for m in logged) == 2
    assert list(scratch.iterdir()) == []


def test_a_feature_statement_is_written_from_the_function_whose_body_was_removed():
    """A property's setter, an implementation after `@overload` stubs, a `def` under `if`."""
    from codedojo.bench.builder import _function_info
    from codedojo.bench.mutate import apply_site, find_sites

    src = ('import sys\nfrom typing import overload\n\n\nclass Box:\n    @property\n'
           '    def value(self):\n        """The stored value."""\n        return self._v\n\n'
           '    @value.setter\n    def value(self, new, check=True):\n'
           '        """Store `new`."""\n        if check and new < 0:\n'
           '            raise ValueError(new)\n        self._v = new\n\n\n'
           '@overload\ndef scale(x: int) -> int: ...\n'
           'def scale(x, factor=2):\n    """Multiply x by factor."""\n    y = x * factor\n'
           '    return y\n\n\n'
           'if sys.version_info >= (3, 8):\n    def greet(name):\n'
           '        """Say hello to name."""\n        msg = "hello " + name\n        return msg\n')
    found = {}
    for s in find_sites(src):
        if s.kind == "remove_body":
            _, site = apply_site(src, s.kind, s.index)
            found.setdefault(site.function, []).append(
                _function_info(src, site.function, site.line))
    assert ("(self, new, check=True)", "Store `new`.") in found["Box.value"]
    assert found["scale"] == [("(x, factor=2)", "Multiply x by factor.")]
    assert found["greet"] == [("(name)", "Say hello to name.")]


def test_a_task_id_names_its_bug_not_the_mutators_count_of_sites(bench_cache, tmp_path,
                                                                  monkeypatch):
    """A mutator that numbers its sites otherwise (another version of it) gives the same bugs
    the same ids: an id never names one bug in one suite and another in the next. Built again,
    the suite's tasks are the same, byte for byte."""
    import dataclasses

    from codedojo.bench import builder

    recipe = builder.BuildRecipe.model_validate({
        "name": "ids", "version": "1", "seed": 5, "runs": 1, "created_at": "2026-01-02T03:04:05Z",
        "pytest": pytest.__version__,
        "packages": [{"requirement": "tinycalc==0.1.0", "bugfix": 1, "feature": 0,
                      "log_investigation": 0, "max_candidates": 40}],
    })
    first = builder.build_suite(recipe, tmp_path / "a", log=lambda m: None)
    find_sites, apply_site = builder.find_sites, builder.apply_site

    def shifted_find(source):  # every site numbered one higher
        return [dataclasses.replace(s, index=s.index + 1) for s in find_sites(source)]

    def shifted_apply(source, kind, index):
        mutant, site = apply_site(source, kind, index - 1)
        return mutant, dataclasses.replace(site, index=index)

    monkeypatch.setattr(builder, "find_sites", shifted_find)
    monkeypatch.setattr(builder, "apply_site", shifted_apply)
    builder.build_suite(recipe, tmp_path / "b", log=lambda m: None)
    assert len(first) == 1
    assert (tmp_path / "b/tasks.jsonl").read_bytes() == (tmp_path / "a/tasks.jsonl").read_bytes()
