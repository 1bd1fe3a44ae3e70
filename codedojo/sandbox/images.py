"""Images: stacks of read-only, content-addressed directory layers, and the builders that make them.

Store layout (under the provider's root):

    layers/<id>/        one layer: a tree laid out as seen from `/` inside the sandbox
    images/<id>.json    {"id", "layers": [top, ..., bottom], "base": "host" | "rootfs", ...}
    names/<name>        the image id a name points to
    tmp/                layers under construction (renamed into place when complete), each
                        with its lock beside it (`<dir>.lock`: see `ImageStore.build_dir`)

A layer is shared by every image built on it, so removing an image (`ImageStore.remove`)
removes only its file and names; `prune` (run by the provider's `gc`) then deletes the layers no
image file names and no mounted sandbox uses.

A layer id is the sha256 of its tree (paths, types, modes, owners, contents, link targets and
overlay whiteouts), so building the same thing twice stores it once, and an image id is the
sha256 of its layer list. Layers are overlayfs lower directories: a deletion is a character
device 0/0 (a whiteout) and a replaced directory carries `trusted.overlay.opaque=y`, exactly as
overlayfs writes them in the upper layer, which is why freezing a sandbox's writable layer is a
plain copy of it.

Two kinds of base:
  * "host" (the fast default): the bottom layer is a skeleton whose /usr (and /bin, /lib*, when
    the host does not link them into /usr) are bound read-only from the host at start, plus a
    copy of the host's /etc keeping only world-readable files (no shadow, no private keys) and a
    passwd entry for the sandbox user. /root, /home, /work and every other host path are simply
    not in the tree.
  * "rootfs": a Debian root made with debootstrap, nothing bound from the host (full isolation).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import posixpath
import re
import shutil
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from codedojo.sandbox.base import WORKSPACE, SandboxError
from codedojo.sandbox.syscalls import open_beneath

if TYPE_CHECKING:
    from codedojo.sandbox.local import LocalProvider

SANDBOX_UID = 1000
SANDBOX_GID = 1000
SANDBOX_HOME = "/home/user"
# Host directories that may be bound into a "host" base, read-only. Anything else stays out.
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
OPAQUE_XATTR = "trusted.overlay.opaque"
ID_LEN = 32  # hex chars of sha256 kept; short ids keep overlay's option string small
_LAYER_ID = re.compile(f"[0-9a-f]{{{ID_LEN}}}")
# `prune` leaves a layer this new: a layer is committed before the image that names it is written.
PRUNE_MIN_AGE_S = 600.0
BUILD_LOCK = ".lock"  # the suffix of a build's lock file, beside its directory under tmp/
# An entry under tmp/ without a lock (a pruned layer being deleted) this old is a leftover.
TMP_MAX_AGE_S = 3600.0


class NoSuchImage(SandboxError):
    """An image id or name the store does not hold."""


@dataclass(frozen=True)
class Image:
    id: str
    layers: tuple[str, ...]  # top first
    base: Literal["host", "rootfs"] = "host"
    names: tuple[str, ...] = field(default=())

    @property
    def binds(self) -> tuple[str, ...]:
        """Host system directories bound read-only at start (none for a rootfs base)."""
        if self.base != "host":
            return ()
        return tuple(d for d in SYSTEM_DIRS if os.path.isdir(f"/{d}") and not os.path.islink(f"/{d}"))


def is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


# Every host-side walk of a tree a sandbox wrote (its live upper layer, a layer frozen from it)
# opens each directory from its parent's fd and each file by its name there, never following a
# link and never blocking on a FIFO: such a tree is the sandbox's, and a link or FIFO in it would
# otherwise lead the host (root) to a host path, or hang it.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# What opening an entry listed earlier meets once it is gone, or is no longer a directory.
_GONE = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)
PATH_MAX = 4096  # the kernel's limit on a path, its final NUL included


def _is_opaque(fd: int) -> bool:
    """Whether directory ``fd`` is an opaque one (overlayfs hides what lower layers hold)."""
    try:
        return os.getxattr(fd, OPAQUE_XATTR) == b"y"
    except OSError:
        return False


Entries = list[tuple[str, os.stat_result]]  # a directory's: (name, lstat)


def _entries(fd: int, rel: str, strict: bool = True) -> Entries:
    """The entries of directory ``fd`` (``rel`` in its tree), sorted by name, with their lstat;
    one gone meanwhile is left out. Not ``strict``: one that cannot be read is left out too,
    and a path of any length is taken."""
    out = []
    try:
        names = sorted(os.listdir(fd))
    except OSError:
        if strict:
            raise
        return out
    for name in names:
        path = posixpath.join(rel, name)
        if strict and (size := len(os.fsencode(path)) + 1) >= PATH_MAX:
            raise SandboxError(f"path: /{path[:60]}... is {size} bytes "
                               f"long, past the {PATH_MAX - 1} that a sandbox's path may have "
                               "to be snapshotted or compared")
        try:
            out.append((name, os.stat(name, dir_fd=fd, follow_symlinks=False)))
        except OSError as e:
            if strict and not isinstance(e, FileNotFoundError):
                raise
    return out


def _open_dir(name: str, dir_fd: int | None = None, strict: bool = True) -> int | None:
    """An fd of directory ``name`` (of ``dir_fd``), never through a link; None where it is
    gone or is no longer a directory (not ``strict``: where it cannot be opened at all)."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in _GONE or not strict:
            return None
        raise


def walk_tree(root: str, under: str = "", *, strict: bool = True,
              on_leave: Callable[[str, int, Entries], None] | None = None
              ) -> Iterator[tuple[str, int, Entries]]:
    """Every directory of the tree at ``root`` (from its directory ``under`` down, if given),
    parents first and siblings in name order, as (its path relative to ``root``, "" for the
    root; an fd of it, open until the walk goes on; its entries sorted by name, with their
    lstat). ``on_leave`` is called with the same three once all below a directory has been
    walked, before its fd is closed.

    Nothing is followed (see `_DIR_FLAGS`): however the tree changes meanwhile, the walk stays
    in it, and what is gone (or is no longer a directory) when the walk reaches it is left
    out. A deep tree costs no recursion and no long host path; a path longer than a sandbox's
    path may be (`PATH_MAX`, counted from its `/`) is a SandboxError. Not ``strict``, what
    cannot be read is left out too, and a path may be of any length (to remove a tree)."""
    rel = ""
    fd = _open_dir(root, strict=strict)
    if fd is None:
        return
    for part in [p for p in under.split("/") if p]:
        try:
            sub = _open_dir(part, fd, strict)
        finally:
            os.close(fd)
        if sub is None:
            return
        fd, rel = sub, posixpath.join(rel, part)
    # the open path: (path, fd, entries, subdirectories left; None until entered)
    stack: list[tuple[str, int, Entries, Iterator[str] | None]] = [(rel, fd, [], None)]
    try:
        while stack:
            rel, fd, entries, subdirs = stack[-1]
            if subdirs is None:  # just entered
                entries = _entries(fd, rel, strict)
                subdirs = iter([n for n, st in entries if stat.S_ISDIR(st.st_mode)])
                stack[-1] = (rel, fd, entries, subdirs)
                yield rel, fd, entries
                continue
            name = next(subdirs, None)
            if name is None:
                stack.pop()
                try:
                    if on_leave is not None:
                        on_leave(rel, fd, entries)
                finally:
                    os.close(fd)
                continue
            sub = _open_dir(name, fd, strict)
            if sub is not None:
                stack.append((posixpath.join(rel, name), sub, [], None))
    finally:
        for _, fd, _, _ in stack:
            os.close(fd)


def _open_file(dir_fd: int, name: str, st: os.stat_result) -> int | None:
    """An fd of regular file ``name`` of directory ``dir_fd``, if it is still the file ``st``
    (its lstat, taken earlier) describes; else None."""
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in _GONE:
            return None
        raise
    now = os.fstat(fd)
    if stat.S_ISREG(now.st_mode) and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
        return fd
    os.close(fd)
    return None


def data_extents(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """The (start, end) ranges of a file's first ``size`` bytes that hold data; the rest are
    holes, which read as zeros and take no disk."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno != errno.ENXIO:  # ENXIO: only a hole is left
                raise
            return
        if start >= size:
            return
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        yield start, end
        pos = end


def _has_holes(fd: int, size: int) -> bool:
    try:
        return size > 0 and os.lseek(fd, 0, os.SEEK_HOLE) < size
    except OSError as e:
        if e.errno != errno.ENXIO:
            raise
        return False


def _file_digest(fd: int, size: int) -> bytes:
    """What a layer's digest takes of a regular file: the sha256 of its bytes; for a file with
    holes, of its data ranges (offsets, lengths, bytes) and size instead, marked as such, so
    that holes cost nothing (a sandbox's `truncate -s 15T` is free, and hashing its zeros
    would take hours)."""
    h = hashlib.sha256()
    holes = _has_holes(fd, size)
    for start, end in data_extents(fd, size) if holes else [(0, size)]:
        if holes:
            h.update(f"{start}:{end}\0".encode())
        while start < end:
            chunk = os.pread(fd, min(1 << 20, end - start), start)
            if not chunk:
                break
            h.update(chunk)
            start += len(chunk)
    if holes:
        h.update(f"size {size}".encode())
        return b"holes " + h.digest()
    return h.digest()


def tree_digest(root: str) -> str:
    """Content address of a layer tree (a second name of a file counts as a link to the
    first, so a tree with hard links is not taken for one without)."""
    h = hashlib.sha256()
    links: dict[tuple[int, int], str] = {}  # (st_dev, st_ino) -> first name seen
    for dir_rel, dir_fd, entries in walk_tree(root):
        st = os.fstat(dir_fd)
        h.update(f"{dir_rel or '.'}\0{st.st_mode:o}\0{st.st_uid}\0{st.st_gid}\0".encode())
        if _is_opaque(dir_fd):
            h.update(b"opaque")
        h.update(b"\n")
        for name, st in entries:
            if stat.S_ISDIR(st.st_mode):
                continue  # (hashed where the walk enters it)
            rel = posixpath.join(dir_rel, name)
            h.update(f"{rel}\0{st.st_mode:o}\0{st.st_uid}\0{st.st_gid}\0".encode())
            first = links.setdefault((st.st_dev, st.st_ino), rel) if (
                stat.S_ISREG(st.st_mode) and st.st_nlink > 1) else rel
            if first != rel:
                h.update(f"link to {first}".encode())
            elif stat.S_ISREG(st.st_mode):
                fd = _open_file(dir_fd, name, st)
                if fd is None:
                    raise SandboxError(f"path: /{rel}: changed while the layer was hashed")
                try:
                    h.update(_file_digest(fd, st.st_size))
                finally:
                    os.close(fd)
            elif stat.S_ISLNK(st.st_mode):
                h.update(os.readlink(name, dir_fd=dir_fd).encode())
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                h.update(str(st.st_rdev).encode())
            h.update(b"\n")
    return h.hexdigest()[:ID_LEN]


def copy_sparse(fi: int, fo: int) -> int:
    """Copy a regular file's data (fd ``fi``) to ``fo``, its holes left holes (a sandbox's
    `truncate -s 1T` takes no disk, and its copy takes none either); returns the bytes of data
    copied."""
    copied = 0
    size = os.fstat(fi).st_size
    for start, end in data_extents(fi, size):
        while start < end:  # (copy_file_range refuses to cross file systems)
            os.lseek(fo, start, os.SEEK_SET)
            n = os.sendfile(fo, fi, start, end - start)
            if n == 0:
                break
            start += n
            copied += n
    os.ftruncate(fo, size)
    return copied


def copy_layer_tree(src: str, dst: str, *, xattrs: bool = True) -> int:
    """Copy an overlay upper (or any) tree, keeping owners, modes, times, whiteouts, hard
    links between its files and the opaque marker; returns bytes copied. Cost is proportional
    to the data in `src` (sparse files stay sparse). A file's setuid and setgid bits are
    dropped: a snapshot must not put a program that runs as the sandbox's user on the host's
    disk. `dst` itself keeps its own times (the times of a layer's root are never seen).
    `src` is read as `walk_tree` reads it: nothing in it is followed."""
    total = 0
    links: dict[tuple[int, int], str] = {}  # (st_dev, st_ino) -> the first copy of a file
    # The copies of the directories on the walk's path, with their sources' stat: a directory's
    # times are set once it is full (filling it changes its mtime), as the walk leaves it.
    filling: list[tuple[str, int, os.stat_result]] = []

    def done(*_: object) -> None:
        rel, fd, st = filling.pop()
        try:
            if rel:
                os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(fd)

    os.makedirs(dst, exist_ok=True)
    try:
        for rel, sfd, entries in walk_tree(src, on_leave=done):
            st = os.fstat(sfd)
            dfd = os.open(posixpath.basename(rel), _DIR_FLAGS, dir_fd=filling[-1][1]) if rel \
                else os.open(dst, _DIR_FLAGS)
            filling.append((rel, dfd, st))
            os.fchown(dfd, st.st_uid, st.st_gid)
            os.fchmod(dfd, stat.S_IMODE(st.st_mode))
            if xattrs and _is_opaque(sfd):
                os.setxattr(dfd, OPAQUE_XATTR, b"y")
            for name, est in entries:
                mode = est.st_mode
                if stat.S_ISDIR(mode):
                    os.mkdir(name, 0o700, dir_fd=dfd)  # (filled, and its owner set, when entered)
                    continue
                if stat.S_ISLNK(mode):
                    try:
                        os.symlink(os.readlink(name, dir_fd=sfd), name, dir_fd=dfd)
                    except FileNotFoundError:
                        continue  # gone meanwhile
                elif stat.S_ISREG(mode) and est.st_nlink > 1 and (est.st_dev, est.st_ino) in links:
                    # another name of a file copied (the first copy's path is in `dst`, which
                    # is this walk's own: no link of the sandbox's is on it)
                    os.link(links[est.st_dev, est.st_ino], name, src_dir_fd=filling[0][1],
                            dst_dir_fd=dfd, follow_symlinks=False)
                    continue
                elif stat.S_ISREG(mode):
                    fi = _open_file(sfd, name, est)
                    if fi is None:
                        raise SandboxError(f"path: /{posixpath.join(rel, name)}: changed while "
                                           "it was copied")
                    try:
                        fo = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                                     | os.O_CLOEXEC, 0o600, dir_fd=dfd)
                        try:
                            total += copy_sparse(fi, fo)
                        finally:
                            os.close(fo)
                    finally:
                        os.close(fi)
                    if est.st_nlink > 1:
                        links[est.st_dev, est.st_ino] = posixpath.join(rel, name)
                elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode):
                    os.mknod(name, mode, est.st_rdev, dir_fd=dfd)
                else:
                    continue  # sockets are not content
                os.chown(name, est.st_uid, est.st_gid, dir_fd=dfd, follow_symlinks=False)
                if not stat.S_ISLNK(mode):  # (what was made here: no link to follow)
                    os.chmod(name, stat.S_IMODE(mode) & ~(stat.S_ISUID | stat.S_ISGID), dir_fd=dfd)
                    os.utime(name, ns=(est.st_atime_ns, est.st_mtime_ns), dir_fd=dfd)
    finally:
        for _, fd, _ in filling:
            os.close(fd)
    return total


def remove_tree(path: str) -> None:
    """Remove a tree however deep, without following a link in it (shutil.rmtree recurses
    once per level, and a sandbox's tree past ~1000 levels stops it). What cannot be removed
    stays, as with ``shutil.rmtree(path, ignore_errors=True)``."""

    def empty(_: str, fd: int, entries: Entries) -> None:  # its subdirectories: empty by now
        for name, st in entries:
            if stat.S_ISDIR(st.st_mode):
                with contextlib.suppress(OSError):
                    os.rmdir(name, dir_fd=fd)

    for _, fd, entries in walk_tree(path, strict=False, on_leave=empty):
        for name, st in entries:
            if not stat.S_ISDIR(st.st_mode):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=fd)
    try:
        os.rmdir(path)
    except NotADirectoryError:
        with contextlib.suppress(OSError):
            os.unlink(path)
    except OSError:
        pass


class LayerStack:
    """Resolve paths through a stack of layer directories the way overlayfs does. A path is
    taken as it is written, through directories only (`open_beneath`): a link on the way is
    not a directory, and hides what lower layers hold below it. What is learnt of a directory
    is kept for the stack's life: make one per look at a tree that changes.

    A layer's root is opened (an O_PATH fd) when a lookup first reaches it, and held for the
    stack's life, so later lookups open no root (a lookup the top layer answers opens none
    below it): `close` it, or use it as a context manager."""

    def __init__(self, dirs: Sequence[str]):
        self.dirs = list(dirs)  # top first
        # (layer, directory) -> (a directory there, whether the layer hides what lower layers
        # have below it: a whiteout, a file or a link on the way, or an opaque directory)
        self._known: dict[tuple[str, tuple[str, ...]], tuple[bool, bool]] = {}
        self._roots: dict[str, int] | None = {}  # layer -> an fd of its root, once reached

    def _root(self, top: str) -> int:
        """Layer ``top``'s root; a layer gone (before or after it was opened) is a
        SandboxError, not an empty layer."""
        if self._roots is None:
            raise ValueError("LayerStack: used after close")
        fd = self._roots.get(top)
        if fd is None:
            try:
                fd = self._roots[top] = os.open(top, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as e:
                raise SandboxError(f"layer {top}: cannot open it ({e.strerror})") from e
        elif os.fstat(fd).st_nlink == 0:  # (removed since: a held directory has no links left)
            raise SandboxError(f"layer {top}: removed while it was read")
        return fd

    def close(self) -> None:
        """Close the layers' roots; the stack is of no use after."""
        roots, self._roots = self._roots or {}, None
        for fd in roots.values():
            os.close(fd)

    def __enter__(self) -> LayerStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _parts(rel: str) -> tuple[str, ...]:
        return tuple(p for p in rel.split("/") if p and p != ".")

    def _open(self, top: str, parts: Sequence[str], flags: int) -> int:
        # (openat2 takes no O_NONBLOCK with O_PATH, which opens nothing that could block)
        nonblock = 0 if flags & os.O_PATH else os.O_NONBLOCK
        return open_beneath(self._root(top), "/".join(parts), flags | os.O_NOFOLLOW | nonblock)

    def _dir(self, top: str, parts: tuple[str, ...]) -> tuple[bool, bool]:
        """Whether layer ``top`` has directory ``parts``, and whether it hides what lower
        layers have below it."""
        todo = []  # the directories on the way not known yet, deepest first
        while parts and (top, parts) not in self._known:
            todo.append(parts)
            parts = parts[:-1]
        state = self._known.get((top, parts), (True, False))  # (a layer's root: a directory)
        for parts in reversed(todo):
            is_dir, hides = state  # the parent's; below what is no directory, none is either
            if is_dir:
                try:
                    fd = self._open(top, parts, os.O_RDONLY | os.O_DIRECTORY)
                except OSError as e:
                    if e.errno not in (*_GONE, errno.EXDEV):
                        raise
                    # absent; or a whiteout, a file or a link, which hide lower layers' entry
                    state = (False, hides or e.errno != errno.ENOENT)
                else:
                    state = (True, hides or _is_opaque(fd))
                    os.close(fd)
            self._known[top, parts] = state
        return state

    def lookup(self, rel: str) -> tuple[str, os.stat_result] | None:
        """The topmost entry for `rel` (relative): the layer directory that holds it and its
        lstat; None if absent."""
        parts = self._parts(rel)
        if not parts:
            return self.dirs[0], os.fstat(self._root(self.dirs[0]))
        for top in self.dirs:
            is_dir, hides = self._dir(top, parts[:-1])
            fd = self._parent(top, parts) if is_dir else None
            st = None
            if fd is not None:
                try:
                    st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    pass
                finally:
                    os.close(fd)
            if st is not None:
                return None if is_whiteout(st) else (top, st)
            if hides:
                return None
        return None

    def _parent(self, top: str, parts: tuple[str, ...]) -> int | None:
        """An O_PATH fd of the directory of ``parts`` in layer ``top``; None if it is gone."""
        try:
            return self._open(top, parts[:-1], os.O_PATH | os.O_DIRECTORY)
        except OSError as e:
            if e.errno in _GONE:
                return None
            raise

    def open(self, top: str, rel: str, st: os.stat_result) -> int | None:
        """An fd of the regular file `rel` of layer ``top`` that `lookup` found (``st``); None
        if it is no longer that file."""
        parts = self._parts(rel)
        fd = self._parent(top, parts)
        if fd is None:
            return None
        try:
            return _open_file(fd, parts[-1], st)
        finally:
            os.close(fd)

    def readlink(self, top: str, rel: str) -> str | None:
        """The target of link `rel` of layer ``top``; None if it is no longer a link."""
        parts = self._parts(rel)
        fd = self._parent(top, parts)
        if fd is None:
            return None
        try:
            return os.readlink(parts[-1], dir_fd=fd)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.EINVAL):
                return None
            raise
        finally:
            os.close(fd)

    def listdir(self, rel: str) -> set[str]:
        names: set[str] = set()
        hidden: set[str] = set()
        parts = self._parts(rel)
        for top in self.dirs:
            is_dir, hides = self._dir(top, parts)
            if is_dir:
                try:
                    fd = self._open(top, parts, os.O_RDONLY | os.O_DIRECTORY)
                except OSError as e:
                    if e.errno not in _GONE:
                        raise
                else:
                    try:
                        for name, st in _entries(fd, "/".join(parts)):
                            if name not in hidden and name not in names:
                                (hidden if is_whiteout(st) else names).add(name)
                    finally:
                        os.close(fd)
            if hides:  # (what lower layers have here is gone)
                break
        return names


class ImageStore:
    """Content-addressed layers and named images under `root`."""

    def __init__(self, root: str, provider: LocalProvider | None = None):
        for d in ("layers", "images", "names", "tmp"):
            os.makedirs(os.path.join(root, d), exist_ok=True)
        self.root = os.path.realpath(root)  # (the mount table names layers by it: `prune`)
        self.provider = provider
        self._base: Image | None = None

    # ---- store ----

    def layer_path(self, layer_id: str) -> str:
        return os.path.join(self.root, "layers", layer_id)

    @contextlib.contextmanager
    def build_dir(self) -> Iterator[str]:
        """A new directory under tmp/ to build a layer in, for the block's life; what is left
        of it after (all of it, unless `commit_layer` moved it into the store) is removed.
        Meanwhile the build holds an flock on its lock file beside it (`BUILD_LOCK`), which
        tells `remove_abandoned_builds` that it is live however long it takes."""
        while True:
            path = os.path.join(self.root, "tmp", uuid.uuid4().hex)
            lock = os.open(path + BUILD_LOCK, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                           0o600)
            fcntl.flock(lock, fcntl.LOCK_EX)
            with contextlib.suppress(FileNotFoundError):
                if os.path.samestat(os.fstat(lock), os.stat(path + BUILD_LOCK)):
                    break
            os.close(lock)  # (taken for an abandoned build's and removed, before it was locked)
        try:
            os.mkdir(path, 0o755)
            yield path
        finally:
            try:
                remove_tree(path)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path + BUILD_LOCK)
            finally:
                os.close(lock)

    def remove_abandoned_builds(self, max_age_s: float = TMP_MAX_AGE_S) -> list[str]:
        """Remove what is left under tmp/ by builds no process runs any more: a build whose
        lock nobody holds (its process ended), and an entry without a lock (a pruned layer
        whose deletion stopped) older than ``max_age_s``. Returns the names removed."""
        tmp = os.path.join(self.root, "tmp")
        names = set(os.listdir(tmp))
        removed = []
        for n in sorted(names):
            p = os.path.join(tmp, n)
            if n.endswith(BUILD_LOCK):
                try:
                    fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue  # (its build ended meanwhile)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue  # a live build
                try:
                    remove_tree(p.removesuffix(BUILD_LOCK))
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(p)
                finally:
                    os.close(fd)
                removed.append(n)
            elif n + BUILD_LOCK not in names:
                with contextlib.suppress(FileNotFoundError):
                    if time.time() - os.lstat(p).st_mtime > max_age_s:
                        remove_tree(p)
                        removed.append(n)
        return removed

    def commit_layer(self, tmp: str) -> str:
        """Move a finished tree into the store under its content address."""
        layer_id = tree_digest(tmp)
        dst = self.layer_path(layer_id)
        try:
            os.rename(tmp, dst)
        except OSError:
            if not os.path.isdir(dst):
                raise
            remove_tree(tmp)  # the same content is already stored
        os.utime(dst)  # new to `prune` until an image names it (its root's times are unseen)
        return layer_id

    def copy_layer(self, layer_id: str, salt: str) -> str:
        """A second copy of a layer under another id (a stack may not hold one dir twice)."""
        new_id = hashlib.sha256(f"{layer_id}:{salt}".encode()).hexdigest()[:ID_LEN]
        dst = self.layer_path(new_id)
        if not os.path.isdir(dst):
            with self.build_dir() as tmp:
                copy_layer_tree(self.layer_path(layer_id), tmp)
                with contextlib.suppress(OSError):  # (else stored meanwhile: the copy goes)
                    os.rename(tmp, dst)
        os.utime(dst)  # (as in commit_layer)
        return new_id

    def put_image(self, layers: Sequence[str], base: str = "host", name: str | None = None,
                  meta: dict | None = None) -> Image:
        for layer in layers:
            if not os.path.isdir(self.layer_path(layer)):
                raise SandboxError(f"image.layers: layer {layer!r} is missing from the store")
        image_id = hashlib.sha256(json.dumps([base, list(layers)]).encode()).hexdigest()[:ID_LEN]
        path = os.path.join(self.root, "images", f"{image_id}.json")
        if not os.path.exists(path):
            doc = {"id": image_id, "layers": list(layers), "base": base, "created": time.time(),
                   **(meta or {})}
            tmp = f"{path}.{uuid.uuid4().hex}"
            with open(tmp, "w") as f:
                json.dump(doc, f)
            os.rename(tmp, path)
        if name:
            self.tag(image_id, name)
        return Image(image_id, tuple(layers), base)  # type: ignore[arg-type]

    def tag(self, image_id: str, name: str) -> None:
        if not name or "/" in name or name.startswith(".") or "\0" in name:
            raise SandboxError(f"name: {name!r} is not a valid image name")
        path = os.path.join(self.root, "names", name)
        tmp = f"{path}.{uuid.uuid4().hex}"
        with open(tmp, "w") as f:
            f.write(image_id)
        os.rename(tmp, path)

    def _image_file(self, ref: str) -> str:
        """The file of an image given by id or name; a missing one is a clear error."""
        if not isinstance(ref, str) or not ref:
            raise SandboxError(f"image: expected an image id or name, got {ref!r}")
        image_id = ref
        name_path = os.path.join(self.root, "names", ref)
        if "/" not in ref and os.path.isfile(name_path):
            with open(name_path) as f:
                image_id = f.read().strip()
        path = os.path.join(self.root, "images", f"{image_id}.json")
        if "/" in image_id or not os.path.isfile(path):
            raise NoSuchImage(f"image: no image or name {ref!r} in {self.root}")
        return path

    def resolve(self, ref: str) -> Image:
        """An image by id or name; a missing image or layer is a clear error."""
        path = self._image_file(ref)
        with open(path) as f:
            doc = json.load(f)
        for layer in doc["layers"]:
            if not os.path.isdir(self.layer_path(layer)):
                raise SandboxError(f"image {ref!r}: layer {layer} is missing from the store")
        return Image(doc["id"], tuple(doc["layers"]), doc.get("base", "host"))

    def remove(self, ref: str, *, force: bool = False) -> str:
        """Delete an image (by id or name) and every name that points to it; returns its id.
        Its layers stay until `prune` finds that no image names them (other images may be
        built on them). Refused while a live sandbox of this store's provider runs on it:
        created from it, forked from it or restored to it (`LocalSandbox.source`), and, unless
        ``force``, when a name points to it: a task's image is named, and a snapshot of a
        sandbox that changed nothing is its image (images are addressed by their layers). A
        snapshot that `fork(n)` took itself is its forks' `source`: remove it once they are
        gone."""
        path = self._image_file(ref)
        image_id = os.path.basename(path).removesuffix(".json")
        if self.provider is not None:
            users = sorted(sb.id for sb in self.provider.list()
                           if image_id in (sb.source, sb.image.id))
            if users:
                raise SandboxError(f"image: {ref!r} is in use by live sandboxes: "
                                   f"{', '.join(users)}")
        names = os.path.join(self.root, "names")
        pointing = [n for n in os.listdir(names) if self._points_to(n, image_id)]
        named = [n for n in pointing if not n.startswith(".")]  # (hidden keys: the base's)
        if named and not force:
            raise SandboxError(f"image: {ref!r} is named ({', '.join(sorted(named))}): kept "
                               "(force=True removes it and its names)")
        for n in pointing:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(names, n))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        if self._base is not None and self._base.id == image_id:
            self._base = None
        return image_id

    def _points_to(self, name: str, image_id: str) -> bool:
        try:
            with open(os.path.join(self.root, "names", name)) as f:
                return f.read().strip() == image_id
        except FileNotFoundError:  # (removed meanwhile)
            return False

    def prune(self, min_age_s: float = PRUNE_MIN_AGE_S) -> list[str]:
        """Delete the layers that no image file names and no sandbox of the store has mounted
        (any process's, read from the mount table); returns their ids. A layer younger than
        ``min_age_s`` stays: it may be one whose image is still being written. An image file
        that cannot be read stops it before anything is deleted (SandboxError)."""
        keep: set[str] = set()
        images = os.path.join(self.root, "images")
        for n in os.listdir(images):
            if not n.endswith(".json"):
                continue  # one being written: its layers are new
            try:
                with open(os.path.join(images, n)) as f:
                    keep.update(json.load(f)["layers"])
            except FileNotFoundError:
                continue  # removed meanwhile
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise SandboxError(f"prune: image file {n} cannot be read ({e}); no layer was "
                                   "deleted") from None
        if self.provider is not None:  # (this process's: mounted or about to be)
            for sb in self.provider.list():
                keep.update(sb.lowers)
                keep.update(sb.image.layers)
        # overlay's options in the mount table name each lower directory, escaped as there
        prefix = "".join(f"\\{ord(c):03o}" if c in ",= \t\n\\" else c
                         for c in self.layer_path(""))
        with open("/proc/self/mountinfo") as f:
            keep.update(re.findall(re.escape(prefix) + f"([0-9a-f]{{{ID_LEN}}})", f.read()))
        removed = []
        now = time.time()
        for n in sorted(os.listdir(os.path.join(self.root, "layers"))):
            if n in keep or not _LAYER_ID.fullmatch(n):
                continue
            doomed = os.path.join(self.root, "tmp", f"pruned-{n}-{uuid.uuid4().hex}")
            try:
                if now - os.lstat(self.layer_path(n)).st_mtime < min_age_s:
                    continue
                os.rename(self.layer_path(n), doomed)  # gone from the store in one step
            except FileNotFoundError:
                continue
            remove_tree(doomed)  # (what is left, gc removes later)
            removed.append(n)
        return removed

    def names(self) -> dict[str, str]:
        out = {}
        d = os.path.join(self.root, "names")
        for n in sorted(os.listdir(d)):
            if n.startswith(".") or ("." in n and len(n.rsplit(".", 1)[1]) == 32):
                continue  # internal keys and tags being written
            with open(os.path.join(d, n)) as f:
                out[n] = f.read().strip()
        return out

    def list(self) -> list[dict]:
        out = []
        d = os.path.join(self.root, "images")
        for f in sorted(os.listdir(d)):
            if f.endswith(".json"):
                with open(os.path.join(d, f)) as fh:
                    out.append(json.load(fh))
        return out

    # ---- builders ----

    def base(self) -> Image:
        """The "host" base image (named "base"): a skeleton plus a filtered copy of /etc.
        Built once per store object (the host's /etc may change between processes)."""
        if self._base is not None:
            return self._base
        # Copying and hashing /etc takes a second or more; a stat-only fingerprint of what the
        # skeleton is made from finds an identical base built earlier in this store.
        key_path = os.path.join(self.root, "names", f".base-{_host_fingerprint()}")
        with contextlib.suppress(OSError, SandboxError), open(key_path) as f:
            self._base = self.resolve(f.read().strip())
            return self._base
        with self.build_dir() as tmp:
            _build_host_skeleton(tmp)
            layer = self.commit_layer(tmp)
        self._base = self.put_image([layer], "host", name="base", meta={"kind": "base"})
        tmp_key = f"{key_path}.{uuid.uuid4().hex}"
        with open(tmp_key, "w") as f:
            f.write(self._base.id)
        os.rename(tmp_key, key_path)
        return self._base

    def _parent(self, parent: str | None) -> Image:
        return self.resolve(parent) if parent else self.base()

    def _stage_dest(self, tmp: str, parent: Image, dest: str) -> str:
        """Create `dest`'s parent directories in a new layer with the attributes they have in
        `parent` (overlayfs takes a directory's owner and mode from the topmost layer)."""
        rel = _clean_dest(dest)
        cur = tmp
        parts = rel.split("/")
        with LayerStack([self.layer_path(x) for x in parent.layers]) as stack:
            for i, part in enumerate(parts[:-1]):
                cur = os.path.join(cur, part)
                os.mkdir(cur)
                found = stack.lookup("/".join(parts[: i + 1]))
                st = found[1] if found and stat.S_ISDIR(found[1].st_mode) else None
                os.chown(cur, st.st_uid if st else 0, st.st_gid if st else 0)
                os.chmod(cur, stat.S_IMODE(st.st_mode) if st else 0o755)
        return os.path.join(tmp, rel)

    def from_directory(self, path: str, *, dest: str = WORKSPACE, parent: str | None = None,
                       name: str | None = None, owner: tuple[int, int] = (SANDBOX_UID, SANDBOX_GID),
                       exclude: Iterable[str] = ()) -> Image:
        """A new image: `parent` (default: the host base) plus the contents of `path` at `dest`,
        owned by `owner` (the sandbox user by default, so the agent can edit it)."""
        if not os.path.isdir(path):
            raise SandboxError(f"path: {path!r} is not a directory")
        base = self._parent(parent)
        with self.build_dir() as tmp:
            target = self._stage_dest(tmp, base, dest)
            ignore = shutil.ignore_patterns(*exclude) if exclude else None
            shutil.copytree(path, target, symlinks=True, ignore=ignore)
            os.chmod(target, 0o755)  # the source may be a private temp dir (0700)
            _chown_tree(target, *owner)
            layer = self.commit_layer(tmp)
        return self.put_image([layer, *base.layers], base.base, name=name,
                              meta={"kind": "directory", "source": os.path.abspath(path)})

    def from_git(self, repo: str, *, rev: str | None = None, dest: str = WORKSPACE,
                 parent: str | None = None, name: str | None = None) -> Image:
        """A checkout of `repo` (a URL or local path) at `rev`, `.git` included."""
        with self.build_dir() as work:
            checkout = os.path.join(work, "checkout")
            run = subprocess.run(["git", "clone", "--quiet", repo, checkout],
                                 capture_output=True, text=True)
            if run.returncode != 0:
                raise SandboxError(f"repo: git clone {repo!r} failed: {run.stderr.strip()}")
            if rev:
                run = subprocess.run(["git", "-C", checkout, "checkout", "--quiet", rev],
                                     capture_output=True, text=True)
                if run.returncode != 0:
                    raise SandboxError(f"rev: git checkout {rev!r} failed: {run.stderr.strip()}")
            return self.from_directory(checkout, dest=dest, parent=parent, name=name)

    def from_python_env(self, packages: Sequence[str] = (), *, dest: str = "/opt/venv",
                        parent: str | None = None, name: str | None = None,
                        python: str = "/usr/bin/python3", pip_args: Sequence[str] = ()) -> Image:
        """A virtual environment at `dest` whose packages pip installs on the host (from the
        registry, or whatever `pip_args` point at), then frozen into a layer.

        `python` must be visible inside the sandbox (under /usr for a host base). The venv is
        built at a temporary path and its scripts' paths are rewritten to `dest`."""
        base = self._parent(parent)
        if base.base == "host" and not python.startswith("/usr/"):
            raise SandboxError(f"python: {python!r} is not inside the sandbox's bound /usr")
        with self.build_dir() as tmp:
            target = self._stage_dest(tmp, base, dest)
            # --without-pip plus the host's pip (`pip --python`) keeps pip itself out of the layer
            # and skips ensurepip, which costs seconds.
            run = subprocess.run([python, "-m", "venv", "--without-pip", target],
                                 capture_output=True, text=True)
            if run.returncode != 0:
                raise SandboxError(f"python: venv creation failed: {run.stderr.strip()}")
            if packages:
                run = subprocess.run(
                    [sys.executable, "-m", "pip", "--python", os.path.join(target, "bin", "python"),
                     "install", "--quiet", "--disable-pip-version-check", *pip_args, *packages],
                    capture_output=True, text=True)
                if run.returncode != 0:
                    raise SandboxError(f"packages: pip install failed: {run.stderr.strip()[-2000:]}")
            _rewrite_prefix(target, dest)
            _chown_tree(target, SANDBOX_UID, SANDBOX_GID)
            layer = self.commit_layer(tmp)
        return self.put_image([layer, *base.layers], base.base, name=name,
                              meta={"kind": "python-env", "packages": list(packages)})

    def from_command(self, command: str | Sequence[str], *, parent: str | None = None,
                     name: str | None = None, timeout: float = 600.0) -> Image:
        """Run `command` in a sandbox of `parent`; its writable layer becomes a new layer."""
        if self.provider is None:
            raise SandboxError("from_command needs a provider to run the sandbox")
        from codedojo.sandbox.base import Limits, SandboxSpec

        base = self._parent(parent)
        sb = self.provider.create(SandboxSpec(image=base.id, limits=Limits(exec_timeout_s=timeout)))
        try:
            res = sb.exec(command, timeout=timeout)
            if res.exit_code != 0:
                raise SandboxError(
                    f"command: exited {res.exit_code}: {(res.stderr or res.stdout)[-2000:]}")
            snap = sb.snapshot()
        finally:
            sb.destroy()
        image = self.resolve(snap)
        if name:
            self.tag(image.id, name)
        return image

    def debootstrap(self, *, suite: str = "bookworm", mirror: str = "http://deb.debian.org/debian",
                    name: str | None = None, packages: Sequence[str] = ()) -> Image:
        """A "rootfs" base: a minimal Debian made by debootstrap (needs the debootstrap package
        and the Debian mirror). Nothing from the host is bound into sandboxes of this image."""
        if shutil.which("debootstrap") is None:
            raise SandboxError("debootstrap: not installed (apt-get install debootstrap)")
        with self.build_dir() as tmp:
            cmd = ["debootstrap", "--variant=minbase"]
            if packages:
                cmd.append("--include=" + ",".join(packages))
            run = subprocess.run([*cmd, suite, tmp, mirror], capture_output=True, text=True)
            if run.returncode != 0:
                raise SandboxError(f"debootstrap failed: {run.stderr.strip()[-2000:]}")
            for d, mode, uid in ((WORKSPACE, 0o755, SANDBOX_UID), (SANDBOX_HOME, 0o755, SANDBOX_UID)):
                p = os.path.join(tmp, d.lstrip("/"))
                os.makedirs(p, exist_ok=True)
                os.chown(p, uid, uid)
                os.chmod(p, mode)
            _add_sandbox_user(os.path.join(tmp, "etc"))
            layer = self.commit_layer(tmp)
        return self.put_image([layer], "rootfs", name=name, meta={"kind": "debootstrap"})


SKELETON_VERSION = "2"  # bump when _build_host_skeleton changes


def _host_fingerprint() -> str:
    """Changes whenever anything the host skeleton copies or links could have changed."""
    h = hashlib.sha256(SKELETON_VERSION.encode())
    for d in SYSTEM_DIRS:
        p = f"/{d}"
        h.update(f"{d}:{os.path.islink(p) and os.readlink(p)}:{os.path.isdir(p)}\n".encode())
    for dirpath, dirnames, filenames in os.walk("/etc"):
        dirnames.sort()
        for n in sorted(filenames + dirnames):
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, n))
                h.update(f"{dirpath}/{n}:{st.st_mode}:{st.st_size}:{st.st_mtime_ns}:{st.st_uid}\n".encode())
    return h.hexdigest()[:ID_LEN]


def _clean_dest(dest: str) -> str:
    norm = os.path.normpath("/" + dest).lstrip("/")
    if not dest.startswith("/") or norm in ("", ".") or ".." in dest.split("/"):
        raise SandboxError(f"dest: {dest!r} must be an absolute path below / without '..'")
    if norm.split("/")[0] in SYSTEM_DIRS + ("proc", "dev"):
        raise SandboxError(f"dest: {dest!r} is a bound system directory")
    return norm


def _chown_tree(path: str, uid: int, gid: int) -> None:
    os.lchown(path, uid, gid)
    for dirpath, dirnames, filenames in os.walk(path):
        for n in dirnames + filenames:
            os.lchown(os.path.join(dirpath, n), uid, gid)


def _rewrite_prefix(venv: str, dest: str) -> None:
    """Point a venv built at `venv` to `dest`: scripts' shebangs, activate scripts, pyvenv.cfg."""
    old, new = venv.encode(), dest.encode()
    for d in (os.path.join(venv, "bin"), venv):
        for n in os.listdir(d):
            p = os.path.join(d, n)
            if os.path.islink(p) or not os.path.isfile(p) or os.path.getsize(p) > 1 << 20:
                continue
            with open(p, "rb") as f:
                data = f.read()
            if old in data and b"\0" not in data[:4096]:
                with open(p, "wb") as f:
                    f.write(data.replace(old, new))


_PASSWD_LINE = f"user:x:{SANDBOX_UID}:{SANDBOX_GID}:sandbox:{SANDBOX_HOME}:/bin/bash\n"
_GROUP_LINE = f"user:x:{SANDBOX_GID}:\n"


def _add_sandbox_user(etc: str) -> None:
    for fname, line, col in (("passwd", _PASSWD_LINE, 2), ("group", _GROUP_LINE, 2)):
        p = os.path.join(etc, fname)
        lines = []
        with contextlib.suppress(OSError), open(p) as f:
            lines = f.readlines()
        want = line.split(":")[col]
        kept = [x for x in lines if x.split(":")[0] != "user"
                and (len(x.split(":")) <= col or x.split(":")[col] != want)]
        with open(p, "w") as f:
            f.writelines([*kept, line])
        os.chmod(p, 0o644)


def _build_host_skeleton(root: str) -> None:
    os.chmod(root, 0o755)
    for d in SYSTEM_DIRS:
        host = f"/{d}"
        if os.path.islink(host):
            os.symlink(os.readlink(host), os.path.join(root, d))
        elif os.path.isdir(host):
            os.mkdir(os.path.join(root, d), 0o755)  # mount point for the read-only bind
    for d, mode, uid in (("proc", 0o555, 0), ("dev", 0o755, 0), ("run", 0o755, 0),
                         ("opt", 0o755, 0), ("mnt", 0o755, 0), ("var", 0o755, 0),
                         ("root", 0o700, 0), ("tmp", 0o1777, 0), ("var/tmp", 0o1777, 0),
                         ("home", 0o755, 0), ("home/user", 0o755, SANDBOX_UID),
                         ("workspace", 0o755, SANDBOX_UID), ("etc", 0o755, 0)):
        p = os.path.join(root, d)
        os.mkdir(p)
        os.chown(p, uid, uid)
        os.chmod(p, mode)
    _make_dev(os.path.join(root, "dev"))
    _copy_public_etc("/etc", os.path.join(root, "etc"))
    _add_sandbox_user(os.path.join(root, "etc"))
    with open(os.path.join(root, "etc", "hostname"), "w") as f:
        f.write("sandbox\n")
    with open(os.path.join(root, "etc", "hosts"), "w") as f:
        f.write("127.0.0.1 localhost sandbox\n::1 localhost\n")
    os.chmod(os.path.join(root, "etc", "hosts"), 0o644)


DEV_NODES = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8), "urandom": (1, 9),
             "tty": (5, 0)}
DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
             "stderr": "/proc/self/fd/2", "ptmx": "pts/ptmx"}


def _make_dev(dev: str) -> None:
    """A minimal /dev inside the base layer itself, so starting a sandbox needs no /dev mounts
    (only a private devpts); the sandbox user has no CAP_MKNOD to add others."""
    for name, (major, minor) in DEV_NODES.items():
        p = os.path.join(dev, name)
        os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(major, minor))
        os.chmod(p, 0o666)
    for name, target in DEV_LINKS.items():
        os.symlink(target, os.path.join(dev, name))
    os.mkdir(os.path.join(dev, "pts"), 0o755)
    os.mkdir(os.path.join(dev, "shm"))
    os.chmod(os.path.join(dev, "shm"), 0o1777)


def _copy_public_etc(src: str, dst: str) -> None:
    """Copy only what any local user could read: files without o+r (shadow, private keys,
    sudoers) are the host's secrets and stay out."""
    for dirpath, dirnames, filenames in os.walk(src):
        out = os.path.join(dst, os.path.relpath(dirpath, src))
        keep = []
        for d in dirnames:
            p = os.path.join(dirpath, d)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                filenames.append(d)
            elif st.st_mode & 0o005 == 0o005 and d not in ("ssh", "private"):
                os.mkdir(os.path.join(out, d))
                os.chmod(os.path.join(out, d), stat.S_IMODE(st.st_mode))
                keep.append(d)
        dirnames[:] = keep
        for n in filenames:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            q = os.path.join(out, n)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(p), q)
            elif stat.S_ISREG(st.st_mode) and st.st_mode & 0o004:
                shutil.copy2(p, q)
