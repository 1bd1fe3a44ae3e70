import json

import pytest

from codedojo.bench.suite import load_suite, save_suite
from codedojo.bench.task import CANARY, Task, TaskFormatError, parse_task

DIFF = "--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a = 1\n+a = 2\n"


def record(**over):
    rec = {
        "instance_id": "pkg-1.0__bug-x", "repo": "pypi/pkg", "version": "1.0", "base": "pkg==1.0",
        "patch": DIFF, "FAIL_TO_PASS": ["tests/test_x.py::test_a"], "PASS_TO_PASS": ["tests/test_x.py::test_b"],
        "problem_statement": "it breaks", "created_at": "2026-01-01T00:00:00Z", "base_sha256": "0" * 64,
        "bug_patch": DIFF, "hidden_paths": ["tests"], "environment": ["pytest==9.2.0"],
    }
    rec.update(over)
    return rec


def test_valid_record_has_defaults_and_canary():
    t = parse_task(record())
    assert t.package == "pkg" and t.category == "bugfix" and t.canary == CANARY
    assert t.test_patch == ""


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"base": "pkg>=1.0"}, "base"),
        ({"FAIL_TO_PASS": []}, "FAIL_TO_PASS"),
        ({"patch": "not a diff"}, "patch"),
        ({"category": "poetry"}, "category"),
        ({"environment": ["pytest"]}, "environment"),
        ({"bug_kinds": ["typo"]}, "bug_kinds"),
        ({"timeouts": {"test_s": -1}}, "timeouts.test_s"),
        ({"timeouts": {"test_s": float("inf")}}, "timeouts.test_s"),
        ({"environment": ["pytest==9.2.0\n"]}, "environment"),
        ({"test_patch": DIFF}, "test_patch"),
        ({"patch": DIFF.replace("a/x.py", "a/../x.py").replace("b/x.py", "b/../x.py")}, "patch"),
        ({"PASS_TO_PASS": ["t.py::a", "t.py::a"]}, "PASS_TO_PASS"),
        ({"hidden_paths": ["../etc"]}, "hidden_paths"),
        ({"image": {"python_path": ["/abs"]}}, "image.python_path"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_bad_field_is_named_with_the_task(over, field):
    with pytest.raises(TaskFormatError) as e:
        parse_task(record(**over))
    assert "pkg-1.0__bug-x" in str(e.value) and f"'{field}'" in str(e.value)


def test_missing_field_and_version_mismatch():
    rec = record()
    del rec["problem_statement"]
    with pytest.raises(TaskFormatError, match="problem_statement"):
        parse_task(rec)
    with pytest.raises(TaskFormatError, match="differs from base"):
        parse_task(record(version="2.0"))


def test_suite_roundtrip_and_tamper_detection(tmp_path):
    a = Task.model_validate(record())
    b = Task.model_validate(record(instance_id="pkg-1.0__bug-y", category="feature"))
    save_suite(tmp_path, "s", "1", [a, b], {"train": [a.instance_id], "test": [b.instance_id]})
    s = load_suite(tmp_path)
    assert [t.instance_id for t in s.split("test")] == ["pkg-1.0__bug-y"]
    assert s["pkg-1.0__bug-x"] == a
    lines = (tmp_path / "tasks.jsonl").read_text().splitlines()
    edited = json.loads(lines[1])
    edited["problem_statement"] = "something else"
    (tmp_path / "tasks.jsonl").write_text(lines[0] + "\n" + json.dumps(edited) + "\n")
    with pytest.raises(TaskFormatError, match="pkg-1.0__bug-y.*content hash"):
        load_suite(tmp_path)
    broken = json.loads(lines[1])
    broken["FAIL_TO_PASS"] = "not a list"
    (tmp_path / "tasks.jsonl").write_text(lines[0] + "\n" + json.dumps(broken) + "\n")
    with pytest.raises(TaskFormatError, match="pkg-1.0__bug-y.*'FAIL_TO_PASS'"):
        load_suite(tmp_path)


def test_split_must_partition(tmp_path):
    a = Task.model_validate(record())
    with pytest.raises(TaskFormatError, match="both splits"):
        save_suite(tmp_path, "s", "1", [a], {"train": [a.instance_id], "test": [a.instance_id]})


def test_a_task_listed_twice_in_one_split_is_named_so(tmp_path):
    a = Task.model_validate(record())
    with pytest.raises(TaskFormatError, match="'pkg-1.0__bug-x': listed twice in split 'train'"):
        save_suite(tmp_path, "s", "1", [a], {"train": [a.instance_id, a.instance_id]})


def test_a_manifest_that_is_not_utf8_is_named(tmp_path):
    a = Task.model_validate(record())
    save_suite(tmp_path, "s", "1", [a], {"train": [a.instance_id]})
    manifest = tmp_path / "manifest.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'"name": "s"', b'"name": "s\xe9"'))
    with pytest.raises(TaskFormatError, match=r"manifest.json: not UTF-8 \(byte \d+\)"):
        load_suite(tmp_path)


def test_a_suite_whose_files_break_its_rules_is_named_not_loaded(tmp_path):
    a = Task.model_validate(record())
    b = Task.model_validate(record(instance_id="pkg-1.0__bug-y"))
    with pytest.raises(TaskFormatError, match="'pkg-1.0__bug-y': in no split"):
        save_suite(tmp_path, "s", "1", [a, b], {"train": [a.instance_id]})
    save_suite(tmp_path, "s", "1", [a, b], {"train": [a.instance_id], "test": [b.instance_id]})
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    good = json.dumps(manifest)
    manifest["tasks"].insert(0, {**manifest["tasks"][0], "sha256": "f" * 64})
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TaskFormatError, match="'pkg-1.0__bug-x': listed twice in manifest"):
        load_suite(tmp_path)
    (tmp_path / "manifest.json").write_text(good)
    tasks = (tmp_path / "tasks.jsonl").read_bytes()
    (tmp_path / "tasks.jsonl").write_bytes(tasks.replace(b"it breaks", b"it br\xe9aks", 1))
    with pytest.raises(TaskFormatError, match=r"tasks.jsonl:1: not UTF-8"):
        load_suite(tmp_path)
    (tmp_path / "tasks.jsonl").write_bytes(b"\n")
    with pytest.raises(TaskFormatError, match="suite 's': no tasks"):
        load_suite(tmp_path)
    with pytest.raises(TaskFormatError, match="suite 'e': no tasks"):
        save_suite(tmp_path / "e", "e", "1", [], {})
    (tmp_path / "tasks.jsonl").unlink()
    (tmp_path / "tasks.jsonl").mkdir()
    with pytest.raises(TaskFormatError, match="tasks.jsonl: Is a directory"):
        load_suite(tmp_path)


def test_tasks_about_the_same_code_are_not_split_across_train_and_test():
    """A bug and a feature task of one function: one's gold patch is the other's answer."""
    import random

    from codedojo.bench.builder import split_tasks

    def diff(line: int) -> str:
        return f"--- a/x.py\n+++ b/x.py\n@@ -{line},1 +{line},1 @@\n-a = {line}\n+a = 0\n"

    tasks = [Task.model_validate(record(instance_id=f"pkg-1.0__bug-{i}", bug_patch=diff(line),
                                        patch=diff(line)))
             for i, line in enumerate([10, 10, 40, 70, 100, 130])]
    together = {"pkg-1.0__bug-0", "pkg-1.0__bug-1"}
    for seed in range(20):
        split = split_tasks(tasks, 0.5, random.Random(seed))
        assert together <= set(split["train"]) or together <= set(split["test"]), seed
        assert sorted(split["train"] + split["test"]) == sorted(t.instance_id for t in tasks)
    assert any(split_tasks(tasks, 0.5, random.Random(s))["test"] for s in range(20))


@pytest.mark.parametrize("iid", ["pkg-1.0__bug-x\n", "..", "a/b", "-x", ""])
def test_an_id_that_is_no_plain_name_is_refused(iid):
    with pytest.raises(TaskFormatError, match="'instance_id'.*is not a plain name"):
        parse_task(record(instance_id=iid))
    assert parse_task(record(instance_id="p" * 150)).instance_id == "p" * 150  # no length cap


def test_paths_in_the_tree_are_stored_as_plainly_written():
    """An import root written "./src" is the folder src: the grader compares paths as written,
    so a root kept as "./src" would not be known as the one the tests import from."""
    t = parse_task(record(hidden_paths=["./tests/"], image={"python_path": ["./src", "lib/"]}))
    assert t.image.python_path == ["src", "lib"] and t.hidden_paths == ["tests"]


def test_tasks_about_the_same_code_are_related_however_their_package_is_spelled():
    """`dot.pkg`, `Dot_Pkg` and `dot-pkg` are one package (PEP 503)."""
    from codedojo.bench.builder import _related

    tasks = [Task.model_validate(record(instance_id=f"p-{i}", base=f"{name}==1.0"))
             for i, name in enumerate(["dot.pkg", "Dot_Pkg", "dot-pkg"])]
    assert _related(tasks) == [{"p-0", "p-1", "p-2"}]
