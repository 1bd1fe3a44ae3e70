"""Where codedojo keeps what it builds or converts once per machine, and how a file or a
directory is written so that no reader ever sees it half-written, and a machine that loses
power after the write keeps it whole (every file is on disk before its name is)."""

from __future__ import annotations

import ctypes
import errno
import glob
import os
import re
import shutil
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO


def cache_dir() -> Path:
    """``$CODEDOJO_CACHE``, else ``~/.cache/codedojo``."""
    return Path(os.environ.get("CODEDOJO_CACHE") or "~/.cache/codedojo").expanduser()


@contextmanager
def staged_dir(dest: str | Path, *, replace: bool) -> Iterator[Path]:
    """A fresh directory beside ``dest`` to write into. When the block ends without an error
    it becomes ``dest`` whole; on an error it is removed and ``dest`` is left as it was.

    ``replace=True`` (a checkpoint written again): an existing ``dest`` is exchanged with the
    new one in one step (`renameat2`), so ``dest`` names a whole copy at every moment, and the
    old one is removed after. Where the file system cannot exchange, the old one is moved aside
    first, and a crash between the two renames leaves it in ``.<name>-old-*/``.
    ``replace=False`` (a cache that many processes may fill at once): when another one put
    ``dest`` there first, its copy stays and this one is dropped.

    The new copy's files and directories are flushed to disk before it takes ``dest``'s
    name, and the parent directory after. It has a plain directory's mode (`chmod_as_made`),
    not mkdtemp's 0o700."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        chmod_as_made(tmp)
        yield tmp
        _sync_tree(tmp)
        if replace and dest.exists():
            if not _exchange(tmp, dest):
                old = Path(tempfile.mkdtemp(prefix=f".{dest.name}-old-", dir=dest.parent))
                os.rename(dest, old / dest.name)
                os.rename(tmp, dest)
                shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                os.rename(tmp, dest)
            except OSError:  # not empty: another process won the race, its copy is as good
                if replace or not dest.is_dir():
                    raise
        _sync(dest.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_staged_leftovers(dest: str | Path) -> list[Path]:
    """Remove what `staged_dir` left beside ``dest`` when its process was killed mid-write (the
    new copy, or with a rename, the old one moved aside), and return what it removed. Only
    where no other process stages ``dest`` at the time: a checkpoint's, that one rank writes.
    A copy moved aside while ``dest`` is gone (a kill between the two renames) is the only
    whole one, and stays."""
    dest = Path(dest)
    name = re.escape(dest.name)
    new = re.compile(rf"\.{name}-[a-z0-9_]{{8}}")
    aside = re.compile(rf"\.{name}-old-[a-z0-9_]{{8}}")
    gone = [p for p in dest.parent.glob(f".{glob.escape(dest.name)}-*")
            if new.fullmatch(p.name)  # (mkdtemp's names)
            or (aside.fullmatch(p.name) and (p / dest.name).is_dir() and dest.exists())]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def _sync(path: Path) -> None:
    """Flush a file's or a directory's contents (a directory's: its names) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_tree(root: Path) -> None:
    """Flush every file and directory under ``root``, and ``root``, to disk (deepest first)."""
    for d, _, files in os.walk(root, topdown=False):
        for f in files:
            p = os.path.join(d, f)
            if os.path.isfile(p) and not os.path.islink(p):  # no link, fifo or socket
                _sync(Path(p))
        _sync(Path(d))


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux `renameat2(RENAME_EXCHANGE)`); False where the C
    library, the file system or a container's syscall filter has no such call."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # when a rewrite asks
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):  # EPERM: seccomp
        return False
    raise OSError(err, f"exchanging {a} and {b}: {os.strerror(err)}")


def write_synced(path: str | Path, write: Callable[[BinaryIO], object]) -> None:
    """Write a new file by ``write`` and have it on disk when this returns: before an index
    that names it (`write_atomic`) says its directory is finished. A file of that name is
    unlinked first, not written over: a hard link to it (a branch's copy of a run's data)
    keeps its bytes."""
    Path(path).unlink(missing_ok=True)
    with open(path, "xb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: str | Path, text: str | bytes | Callable[[BinaryIO], object]) -> None:
    """Replace the file's text whole: a reader, or a crash at any point, sees the old text or
    the new, never part of it (a report rewritten after every stage, an index that says a
    directory is finished, a data file exported again). ``text`` is the new text, or a
    function that writes it to the file it is given. The file is a new one, so a hard link to
    the old stays as it was. It is on disk before it takes the name, and the name is on disk
    when this returns; a write that fails leaves the old file as it was."""
    path = Path(path)
    fd, tmp = temp_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(text):
                text(f)
            else:
                f.write(text.encode() if isinstance(text, str) else text)
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def chmod_as_made(path: str | Path) -> None:
    """Give a directory or file made private by what made it (mkdtemp's 0o700; mkstemp's and
    safetensors' 0o600) the mode a plain one gets: 0o777 or 0o666 less the process's umask."""
    os.chmod(path, _mode_as_made(Path(path).is_dir()))


def save_tensors(tensors: dict[str, Any], path: str | Path) -> None:
    """``tensors`` as a safetensors file at ``path``, with a plain file's mode
    (`chmod_as_made`: safetensors makes it 0o600)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
    chmod_as_made(path)


def _mode_as_made(directory: bool) -> int:
    return (0o777 if directory else 0o666) & ~_umask()


def _umask() -> int:
    """The process's umask, read where Linux shows it rather than set and set back (a file
    another thread made in between would get the mask set)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o777)  # (in between, the strictest)
    os.umask(mask)
    return mask


def temp_beside(path: Path) -> tuple[int, str]:
    """(fd, name) of a new file in ``path``'s directory, to write and then `publish` as
    ``path``; it has the mode of the file it will replace, else a plain file's
    (`chmod_as_made`; mkstemp's is 0o600)."""
    mode = path.stat().st_mode & 0o777 if path.exists() else _mode_as_made(False)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    return fd, tmp


def publish(tmp: str, path: Path) -> None:
    """Give the written file ``tmp`` the name ``path`` in one step, and put the name on disk."""
    os.replace(tmp, path)
    _sync(path.parent)


def make_way_for_socket(path: str | Path, serving: str) -> None:
    """Make way for a unix socket at ``path``: nothing there, or a socket no process listens
    on (left by a ``serving`` that died), which is removed. Anything else is refused with a
    FileExistsError: a file that is not a socket, or the socket of a ``serving`` that
    serves."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(f"{path} exists and is not a socket (not replaced)")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5.0)
        try:
            s.connect(str(path))
        except ConnectionRefusedError:  # no one listens: a leftover
            path.unlink(missing_ok=True)
            return
        except FileNotFoundError:  # (removed meanwhile)
            return
        except (TimeoutError, BlockingIOError):  # a listener too busy to accept is one
            pass
    raise FileExistsError(f"another {serving} serves on {path}")
