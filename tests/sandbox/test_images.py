"""Layer trees: how a snapshot copies a sandbox's writable layer and addresses it."""

from __future__ import annotations

import os
import time

from codedojo.sandbox import images
from codedojo.sandbox.images import copy_layer_tree, tree_digest


def test_a_snapshot_being_built_is_not_taken_for_a_leftover(sandbox, provider, monkeypatch):
    """A writable layer untouched for two hours: its copy under tmp/ is still a build in
    progress, which a `gc` meanwhile leaves alone."""
    sandbox.exec("echo v1 > /workspace/new.txt")
    old = time.time() - 7200
    os.utime(os.path.join(sandbox._rw, "upper"), (old, old))
    real_digest = images.tree_digest
    kept = []

    def digest_after_gc(root: str) -> str:
        provider.gc()  # another caller's gc, while the snapshot is being built
        kept.append(os.path.isdir(root))
        return real_digest(root)

    monkeypatch.setattr(images, "tree_digest", digest_after_gc)
    snap = sandbox.snapshot()
    assert kept == [True]
    (f,) = sandbox.fork(1, snap)
    try:
        assert f.read_file("new.txt") == b"v1\n"
    finally:
        f.destroy()


def test_hard_links_survive_a_snapshot(sandbox):
    """Two names of one file in the writable layer are one file in a fork too."""
    sandbox.exec("echo one > a && mkdir d && ln a b && ln a d/c && echo two > e")
    (f,) = sandbox.fork(1)
    try:
        out = f.exec("stat -c '%h %i' a b d/c e").stdout.split("\n")
        assert out[0] == out[1] == out[2] and out[0].startswith("3 ")
        assert out[3].startswith("1 ") and out[3] != out[0]
    finally:
        f.destroy()


def test_a_tree_with_hard_links_is_copied_and_addressed_as_such(tmp_path):
    for tree in ("linked", "copied"):
        os.makedirs(tmp_path / tree / "d")
        (tmp_path / tree / "a").write_text("one\n")
    os.link(tmp_path / "linked" / "a", tmp_path / "linked" / "d" / "b")
    (tmp_path / "copied" / "d" / "b").write_text("one\n")
    copy_layer_tree(str(tmp_path / "linked"), str(tmp_path / "out"))
    a, b = os.stat(tmp_path / "out" / "a"), os.stat(tmp_path / "out" / "d" / "b")
    assert (a.st_ino, a.st_nlink) == (b.st_ino, 2)
    # The same content without the link is another tree (a fork of it would differ).
    assert tree_digest(str(tmp_path / "out")) == tree_digest(str(tmp_path / "linked"))
    assert tree_digest(str(tmp_path / "linked")) != tree_digest(str(tmp_path / "copied"))
