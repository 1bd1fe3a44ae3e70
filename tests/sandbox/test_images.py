"""Layer trees: how a snapshot copies a sandbox's writable layer and addresses it."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from codedojo.sandbox import images
from codedojo.sandbox.base import SandboxError, SandboxSpec
from codedojo.sandbox.images import ImageStore, LayerStack, copy_layer_tree, tree_digest
from tests.sandbox.conftest import SMALL, fds_under


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


def test_a_live_build_is_kept_however_old_and_an_abandoned_one_goes(sandbox, provider,
                                                                    monkeypatch):
    """A build under tmp/ is told live by its lock, not its age: one two hours old is kept by
    `gc` while it is built, one whose process ended (its lock held by none) goes however new,
    and an entry without a lock (a pruned layer left half deleted) goes once old."""
    tmp = os.path.join(provider.root, "tmp")
    old = time.time() - 7200
    abandoned = os.path.join(tmp, uuid.uuid4().hex)
    os.mkdir(abandoned)
    open(abandoned + ".lock", "w").close()  # as a build whose process was killed leaves them
    leftover = os.path.join(tmp, f"pruned-{uuid.uuid4().hex}")
    os.mkdir(leftover)
    os.utime(leftover, (old, old))
    sandbox.exec("echo v1 > /workspace/new.txt")
    real_digest = images.tree_digest
    kept = []

    def digest_after_gc(root: str) -> str:
        os.utime(root, (old, old))
        provider.gc()  # another caller's gc, two hours into the build
        kept.append(os.path.isdir(root))
        return real_digest(root)

    monkeypatch.setattr(images, "tree_digest", digest_after_gc)
    sandbox.snapshot()
    assert kept == [True]
    for gone in (abandoned, abandoned + ".lock", leftover):
        assert not os.path.lexists(gone)
    assert [n for n in os.listdir(tmp) if n.endswith(".lock")] == []  # (the build's own: gone)


def test_a_layer_stack_holds_its_layers_open_until_closed(tmp_path):
    for d in ("top", "low"):
        (tmp_path / d).mkdir()
    (tmp_path / "low" / "f").write_text("x")
    (tmp_path / "top" / "g").write_text("y")
    assert fds_under(str(tmp_path)) == set()
    with LayerStack([str(tmp_path / "top"), str(tmp_path / "low")]) as stack:
        assert stack.lookup("g") is not None  # (answered by the top layer: low not opened)
        assert len(fds_under(str(tmp_path))) == 1
        assert stack.lookup("f") is not None
        assert len(fds_under(str(tmp_path))) == 2
        os.rename(tmp_path / "low", tmp_path / "moved")  # (held: still read)
        found = stack.lookup("f")
        assert found is not None and found[1].st_size == 1
    assert fds_under(str(tmp_path)) == set()
    with LayerStack([str(tmp_path / "top"), str(tmp_path / "low")]) as stack:
        with pytest.raises(SandboxError, match="low: cannot open it"):  # (not an empty layer)
            stack.lookup("f")
    assert fds_under(str(tmp_path)) == set()
    (tmp_path / "low").mkdir()
    with LayerStack([str(tmp_path / "top"), str(tmp_path / "low")]) as stack:
        assert stack.lookup("f") is None
        os.rmdir(tmp_path / "low")  # removed once reached: no empty layer either
        with pytest.raises(SandboxError, match="low: removed while it was read"):
            stack.lookup("f")
    with pytest.raises(ValueError, match="used after close"):
        stack.lookup("f")
    assert fds_under(str(tmp_path)) == set()


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


def test_a_tree_past_path_max_is_removed_and_nothing_in_it_followed(tmp_path):
    """`remove_tree` takes a tree of any depth and path length (3000 levels, 6000 bytes),
    removes a link or a FIFO in it, never what a link leads to, and a link or a file given
    itself; a tree copied keeps its directories' times (set as the copy leaves each)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "kept.txt").write_text("x")
    tree = tmp_path / "tree"
    tree.mkdir()
    fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(3000):
            os.mkdir("d", dir_fd=fd)
            sub = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = sub
        os.symlink(str(outside), "link", dir_fd=fd)
        os.mkfifo("fifo", dir_fd=fd)
        with open(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=fd), "w") as f:
            f.write("deep")
    finally:
        os.close(fd)
    (tree / "top.txt").write_text("t")
    os.symlink(str(outside), tree / "top-link")
    images.remove_tree(str(tree))
    assert not tree.exists() and (outside / "kept.txt").read_text() == "x"
    os.symlink(str(outside), tmp_path / "link")
    images.remove_tree(str(tmp_path / "link"))
    assert not os.path.lexists(tmp_path / "link") and (outside / "kept.txt").exists()
    images.remove_tree(str(outside / "kept.txt"))
    images.remove_tree(str(tmp_path / "missing"))
    assert os.listdir(outside) == []
    (outside / "a" / "b").mkdir(parents=True)
    for d, t in ((outside / "a" / "b", 1000), (outside / "a", 2000)):
        os.utime(d, (t, t))
    copy_layer_tree(str(outside), str(tmp_path / "copy"))
    assert [os.stat(tmp_path / "copy" / p).st_mtime for p in ("a/b", "a")] == [1000, 2000]


def _age(store: ImageStore, *layers: str) -> None:
    old = time.time() - 7200
    for layer in layers:
        os.utime(store.layer_path(layer), (old, old))


def test_removed_images_give_back_the_layers_nothing_else_uses(provider, project, tmp_path):
    """A layer is shared: removing an image leaves those another image names, a live
    sandbox's (any process's, from the mount table) and new ones; `gc` prunes the rest. An
    image a live sandbox runs on, a fork's snapshot included, is not removed."""
    store = provider.images
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "f.txt").write_text(uuid.uuid4().hex)  # layers no other test has
    a = store.from_directory(str(tmp_path / "a"), name="prune-a")
    b = store.from_directory(str(tmp_path / "b"), parent=a.id, name="prune-b")
    top_a, top_b = a.layers[0], b.layers[0]
    _age(store, top_a, top_b)
    with pytest.raises(SandboxError, match="is named \\(prune-a\\): kept"):
        store.remove(a.id)  # (a task's image is named)
    assert store.remove("prune-a", force=True) == a.id
    for ref in ("prune-a", a.id):
        with pytest.raises(SandboxError, match="no image or name"):
            store.resolve(ref)
    assert top_a not in store.prune()  # b is built on it
    sb = provider.create(SandboxSpec(image="prune-b", limits=SMALL))
    try:
        with pytest.raises(SandboxError, match=f"in use by live sandboxes: {sb.id}"):
            store.remove(b.id)
        # a snapshot of a sandbox that changed nothing is its image, which stays
        assert sb.snapshot() == b.id
        sb.write_file("new.txt", "x")
        (fork,) = sb.fork(1)  # the snapshot it takes is the fork's source
        (snap_layer,) = set(store.resolve(fork.source).layers) - set(b.layers)
        with pytest.raises(SandboxError, match=f"in use by live sandboxes: {fork.id}"):
            store.remove(fork.source)
        fork.destroy()
        store.remove(fork.source)
        assert snap_layer not in store.prune()  # new: its image may be being written
        _age(store, snap_layer)
        # seen from another process, which knows nothing of `sb`: its layers are mounted
        other = ImageStore(provider.root)
        other.remove(b.id, force=True)
        assert {top_a, top_b} & set(other.prune()) == set()
        assert snap_layer not in os.listdir(os.path.join(provider.root, "layers"))
        assert sb.exec("cat f.txt").exit_code == 0
    finally:
        sb.destroy()
    provider.gc()
    kept = os.listdir(os.path.join(provider.root, "layers"))
    assert top_a not in kept and top_b not in kept
    assert set(store.base().layers) <= set(kept)
    assert store.resolve(project)
