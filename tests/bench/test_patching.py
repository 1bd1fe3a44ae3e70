import pytest

from codedojo.bench.patching import (
    PatchError,
    apply_patch,
    apply_patch_to_dir,
    make_diff,
    parse_patch,
)


def test_roundtrip_modify_add_delete(tmp_path):
    before = {"a.py": "x = 1\ny = 2\nz = 3\n", "gone.py": "bye\n", "nonl.py": "no newline"}
    after = {"a.py": "x = 1\ny = 20\nz = 3\n", "new/b.py": "hello\n", "nonl.py": "still none"}
    diff = make_diff(before, after)
    for rel, text in before.items():
        (tmp_path / rel).write_text(text)
    apply_patch_to_dir(diff, tmp_path)
    assert (tmp_path / "a.py").read_text() == after["a.py"]
    assert (tmp_path / "new/b.py").read_text() == "hello\n"
    assert (tmp_path / "nonl.py").read_text() == "still none"
    assert not (tmp_path / "gone.py").exists()
    # and the reverse diff restores the original
    back = make_diff(after, before)
    apply_patch_to_dir(back, tmp_path)
    assert {p: (tmp_path / p).read_text() for p in before} == before


def test_context_mismatch_is_an_error():
    diff = make_diff({"a.py": "x = 1\n"}, {"a.py": "x = 2\n"})
    with pytest.raises(PatchError, match="does not match"):
        apply_patch(diff, lambda p: "x = 5\n")
    with pytest.raises(PatchError, match="does not exist"):
        apply_patch(diff, lambda p: None)
    with pytest.raises(PatchError, match="no file headers"):
        apply_patch("hello", lambda p: "")


def test_a_hunk_cut_short_by_the_patchs_end_is_an_error():
    files = {"a.py": "x = 1\ny = 2\nz = 3\n"}
    patch = "--- a/a.py\n+++ b/a.py\n@@ -1,3 +1,3 @@\n-x = 1\n+x = 9\n"
    with pytest.raises(PatchError, match=r"a\.py: hunk '@@ -1,3 \+1,3 @@' ends after 1 old"):
        apply_patch(patch, files.get)
    assert apply_patch(patch + " y = 2\n z = 3\n", files.get) == {"a.py": "x = 9\ny = 2\nz = 3\n"}


def test_lines_end_at_newlines_alone_and_paths_stay_in_the_tree():
    """A form feed or a line separator inside a line is no line break to a diff; a patch's
    path cannot lead out of the tree it is applied to."""
    before = {"m.py": "x = 1\n\x0c\ny = 'a\u2028b'\nz = 3\n"}
    after = {"m.py": "x = 1\n\x0c\ny = 'a\u2028b'\nz = 4\n"}
    patch = make_diff(before, after)
    assert apply_patch(patch, before.get) == after
    for bad in ("../outside.txt", "/etc/passwd", "a/../../x"):
        with pytest.raises(PatchError, match="must stay inside the tree"):
            parse_patch(f"--- /dev/null\n+++ b/{bad}\n@@ -0,0 +1 @@\n+x\n")


def test_a_shifted_hunk_goes_where_its_block_stands_nearest_and_hunks_may_not_overlap():
    """Two identical functions, the file shifted a line by an edit elsewhere: the function the
    hunk names is patched, not the first that matches; a hunk inside the one before is
    refused, not applied twice over."""
    block = "\n\n\ndef f(x):\n    if x:\n        return 1\n    return 0\n\n\n\n"
    orig = "# header\n" + block + block
    diff = make_diff({"m.py": orig}, {"m.py": "# header\n" + block +
                                      block.replace("return 1", "return 2")})
    out = apply_patch(diff, {"m.py": "import os\n" + orig}.get)["m.py"]
    assert out == "import os\n# header\n" + block + block.replace("return 1", "return 2")
    src = "".join(f"l{i}\n" for i in range(1, 11))
    overlapping = ("--- a/m.py\n+++ b/m.py\n@@ -2,3 +2,3 @@\n l2\n-l3\n+L3\n l4\n"
                   "@@ -3,2 +3,2 @@\n l3\n-l4\n+L4\n")
    with pytest.raises(PatchError, match="hunk at line 3 overlaps the hunk before it"):
        apply_patch(overlapping, {"m.py": src}.get)
