"""`staged_dir`: a directory appears whole or not at all, and a failed rewrite keeps the old."""

from __future__ import annotations

import os

import pytest

from codedojo.paths import staged_dir, write_atomic, write_synced


def entries(parent):
    return sorted(p.name for p in parent.iterdir())


def test_a_directory_appears_only_when_its_block_ends(tmp_path):
    dest = tmp_path / "ckpt" / "final"
    with staged_dir(dest, replace=True) as tmp:
        (tmp / "model.safetensors").write_text("weights")
        assert not dest.exists()  # a reader sees nothing until the block ends
    assert (dest / "model.safetensors").read_text() == "weights"
    assert entries(dest.parent) == ["final"]


def test_a_rewrite_replaces_the_old_copy_and_a_failed_one_keeps_it(tmp_path):
    dest = tmp_path / "final"
    with staged_dir(dest, replace=True) as tmp:
        (tmp / "a").write_text("1")
    with staged_dir(dest, replace=True) as tmp:
        (tmp / "b").write_text("2")
    assert entries(dest) == ["b"]  # replaced whole, not merged
    with pytest.raises(RuntimeError, match="disk full"), staged_dir(dest, replace=True) as tmp:
        (tmp / "c").write_text("3")
        raise RuntimeError("disk full")
    assert entries(dest) == ["b"]
    assert entries(tmp_path) == ["final"]  # no staging or old copies left behind


def test_a_cache_filled_twice_keeps_the_first_copy(tmp_path):
    dest = tmp_path / "sdists" / "pkg-1.0"
    with staged_dir(dest, replace=False) as first:
        (first / "pkg-1.0.tar.gz").write_text("first")
        with staged_dir(dest, replace=False) as second:  # another process, finishing first
            (second / "pkg-1.0.tar.gz").write_text("second")
    assert (dest / "pkg-1.0.tar.gz").read_text() == "second"
    assert entries(dest.parent) == ["pkg-1.0"]
    (dest / "pkg-1.0.tar.gz").unlink()
    with staged_dir(dest, replace=False) as tmp:  # an empty leftover is filled, not kept
        (tmp / "pkg-1.0.tar.gz").write_text("third")
    assert (dest / "pkg-1.0.tar.gz").read_text() == "third"


def test_a_file_is_replaced_whole_and_a_failed_write_keeps_the_old(tmp_path):
    report = tmp_path / "report.json"
    write_atomic(report, '{"stage": 1}')
    assert report.stat().st_mode & 0o777 == 0o644  # readable as a plain file is
    link = tmp_path / "branch-report.json"
    link.hardlink_to(report)  # a branch of the run shares the file
    write_atomic(report, '{"stage": 2}')
    assert report.read_text() == '{"stage": 2}' and link.read_text() == '{"stage": 1}'
    with pytest.raises(TypeError):
        write_atomic(report, None)  # the write fails part way
    assert report.read_text() == '{"stage": 2}'
    assert entries(tmp_path) == ["branch-report.json", "report.json"]  # no temporary left


@pytest.mark.parametrize("exchange", [True, False])
def test_a_rewrite_swaps_the_copies_in_one_step_where_it_can(tmp_path, monkeypatch, exchange):
    """`renameat2` exchanges the two directories, so the name is never without a whole copy;
    where it cannot, the old copy is moved aside first (two renames)."""
    import os

    from codedojo import paths

    dest = tmp_path / "final"
    with staged_dir(dest, replace=True) as tmp:
        (tmp / "a").write_text("1")
    if not exchange:
        monkeypatch.setattr(paths, "_exchange", lambda a, b: False)
    moved_away = []
    real = os.rename
    monkeypatch.setattr(os, "rename", lambda a, b: moved_away.append(a == dest) or real(a, b))
    with staged_dir(dest, replace=True) as tmp:
        (tmp / "b").write_text("2")
    assert entries(dest) == ["b"] and entries(tmp_path) == ["final"]
    assert any(moved_away) == (not exchange)


def test_packed_rows_are_saved_whole_or_not_at_all(tmp_path, monkeypatch):
    import numpy as np

    from codedojo.data.packing import Packed, pack

    rows = pack([np.arange(1, 9), np.arange(1, 5)], seq_len=4)
    out = tmp_path / "packed"
    real = np.save

    def fail_at_mask(path, arr):
        if str(path).endswith("mask.npy"):
            raise OSError("disk full")
        real(path, arr)

    monkeypatch.setattr(np, "save", fail_at_mask)
    with pytest.raises(OSError, match="disk full"):
        rows.save(out)
    assert not out.exists()
    out.mkdir()
    real(out / "tokens.npy", rows.tokens[:1])  # what a killed writer of the old kind left
    monkeypatch.setattr(np, "save", real)
    rows.save(out)
    np.testing.assert_array_equal(Packed.load(out).tokens, rows.tokens)


@pytest.mark.parametrize("replace", [True, False])
def test_what_is_written_is_on_disk_before_it_takes_its_name(tmp_path, monkeypatch, replace):
    """Every file and directory of a new copy is flushed before the rename that names it, and
    the parent directory (which holds the name) after; so is a file replaced whole."""
    import os

    events = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd):
        events.append(("sync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", lambda a, b: events.append(("name",)) or real_rename(a, b))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("name",)) or real_replace(a, b))
    dest = tmp_path / "final"
    with staged_dir(dest, replace=replace) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "w.bin").write_bytes(b"w")
        (tmp / "config.json").write_text("{}")
        os.symlink("config.json", tmp / "link")
        os.mkfifo(tmp / "pipe")  # opened for a flush, a fifo would block
    staged = {str(tmp / p) for p in ("", "sub", "sub/w.bin", "config.json")}
    named = events.index(("name",))
    assert {p for _, p in events[:named]} == {p.rstrip("/") for p in staged}
    assert events[named + 1:] == [("sync", str(tmp_path))]

    events.clear()
    write_atomic(tmp_path / "report.json", "{}")
    (_, written), name, parent = events
    assert written.startswith(str(tmp_path / ".report.json-")) and name == ("name",)
    assert parent == ("sync", str(tmp_path))


def test_a_file_written_again_leaves_a_hard_link_to_the_old_one_as_it_was(tmp_path):
    """A branch hard-links a run's data: a part the branch writes again is a new file."""
    write_synced(tmp_path / "part.bin", lambda f: f.write(b"source"))
    os.link(tmp_path / "part.bin", tmp_path / "linked.bin")
    write_synced(tmp_path / "part.bin", lambda f: f.write(b"branch"))
    assert (tmp_path / "part.bin").read_bytes() == b"branch"
    assert (tmp_path / "linked.bin").read_bytes() == b"source"


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_what_is_written_has_the_mode_the_umask_gives(tmp_path, mask):
    """A staged directory, a file written whole and the weights of a checkpoint are as open as
    a plain directory or file under the umask (mkdtemp and safetensors make them private)."""
    import torch

    from codedojo.model.config import ModelConfig
    from codedojo.model.hf import save_hf
    from codedojo.model.mtp import MTP
    from codedojo.model.transformer import Transformer
    from codedojo.pretrain.checkpoint import TrainPosition, save_checkpoint

    old = os.umask(mask)
    try:
        torch.manual_seed(0)
        cfg = ModelConfig.tiny(vocab_size=64, max_seq_len=32)
        model = Transformer(cfg)
        ck = save_checkpoint(tmp_path / "ckpt" / "final", model, cfg, MTP(cfg, 1), None,
                             TrainPosition(0, 0, {}, True))
        hf = save_hf(model, cfg, tmp_path / "hf")
        with staged_dir(tmp_path / "cache", replace=False) as tmp:
            (tmp / "a").write_text("1")
        write_atomic(tmp_path / "report.json", "{}")
    finally:
        os.umask(old)

    def mode(p):
        return oct(p.stat().st_mode & 0o777)

    for d in (ck, tmp_path / "cache"):
        assert mode(d) == oct(0o777 & ~mask), d
    for f in (ck / "model.safetensors", ck / "mtp.safetensors", ck / "state.json",
              hf / "model.safetensors", tmp_path / "report.json"):
        assert mode(f) == oct(0o666 & ~mask), f


def test_what_a_killed_rewrite_left_is_removed_and_nothing_else(tmp_path):
    """A process killed inside `staged_dir` leaves its copy beside ``dest``; a checkpoint's
    next save removes it (`remove_staged_leftovers`), not what other names stage there."""
    import signal
    import subprocess
    import sys

    from codedojo.paths import remove_staged_leftovers

    dest = tmp_path / "bulk"
    code = ("import os, signal, sys\nfrom codedojo.paths import staged_dir\n"
            "with staged_dir(sys.argv[1], replace=True) as tmp:\n"
            "    (tmp / 'model.safetensors').write_bytes(b'x' * 1000)\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n")
    r = subprocess.run([sys.executable, "-c", code, str(dest)])
    assert r.returncode == -signal.SIGKILL
    (left,) = tmp_path.iterdir()
    assert left.name.startswith(".bulk-")
    others = [tmp_path / ".bulk-long-abcd1234", tmp_path / ".bulkier-abcd1234", tmp_path / "bulk2"]
    for d in others:
        d.mkdir()
    assert remove_staged_leftovers(dest) == [left]
    assert sorted(tmp_path.iterdir()) == sorted(others)

    # A copy moved aside (a rewrite killed between its two renames) is the only whole one
    # while ``dest`` is gone, and stays; a stage named "bulk-old" stages its own copy there.
    aside = tmp_path / ".bulk-old-abcd1234"
    (aside / "bulk").mkdir(parents=True)
    (tmp_path / ".bulk-old-live0000").mkdir()  # ("bulk-old"'s copy being written)
    assert remove_staged_leftovers(dest) == []
    dest.mkdir()
    assert remove_staged_leftovers(dest) == [aside]
    assert (tmp_path / ".bulk-old-live0000").is_dir()
