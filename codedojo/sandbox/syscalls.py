"""Thin ctypes wrappers for the Linux calls Python 3.11 lacks: mount, umount2 and openat2.

openat2 with RESOLVE_BENEATH and RESOLVE_NO_SYMLINKS is how the host takes each step into a
sandbox's tree: one name below a directory it holds, following no link at all (the host's walk
of a path, `LocalSandbox._walk`, follows the sandbox's links itself, inside its root), and how
it reads a layer's tree (a sandbox's writable layer, or one frozen from it) as plain
directories.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.syscall.restype = ctypes.c_long

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2

SYS_openat2 = 437
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08


def _check(rc: int, what: str) -> None:
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str, target: str, fstype: str | None, flags: int = 0, data: str = "") -> None:
    rc = _libc.mount(
        source.encode(),
        target.encode(),
        fstype.encode() if fstype else None,
        flags,
        data.encode() if data else None,
    )
    _check(rc, f"mount {fstype or source} on {target}")


def umount(target: str, flags: int = MNT_DETACH) -> None:
    _check(_libc.umount2(target.encode(), flags), f"umount {target}")


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _openat2(dir_fd: int, path: str, flags: int, mode: int, resolve: int) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, resolve)
    rel = path.lstrip("/") or "."
    fd = _libc.syscall(SYS_openat2, dir_fd, os.fsencode(rel), ctypes.byref(how),
                       ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


def open_beneath(dir_fd: int, path: str, flags: int) -> int:
    """Open `path` below directory `dir_fd` through directories only: a link anywhere on it,
    the last name included, is ELOOP, and a `..` leaving `dir_fd` is EXDEV."""
    return _openat2(dir_fd, path, flags, 0, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)


# The new mount API: one fsconfig call per lower layer ("lowerdir+", Linux 6.8+), so a stack
# is not limited by the single 4 KiB option string of mount(2) (about 60 layers here).
SYS_move_mount, SYS_fsopen, SYS_fsconfig, SYS_fsmount = 429, 430, 431, 432
FSCONFIG_SET_STRING = 1
FSCONFIG_CMD_CREATE = 6
MOVE_MOUNT_F_EMPTY_PATH = 4


def mount_overlay(target: str, lowers: list[str], upper: str, work: str,
                  options: dict[str, str]) -> None:
    def call(nr: int, *args: object) -> int:
        rc = _libc.syscall(nr, *args)
        if rc < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"overlay mount on {target}: {os.strerror(err)}")
        return rc

    fs = call(SYS_fsopen, b"overlay", 1)
    try:
        def setstr(key: str, value: str) -> None:
            call(SYS_fsconfig, fs, FSCONFIG_SET_STRING, key.encode(), value.encode(), 0)

        for layer in lowers:
            setstr("lowerdir+", layer)
        setstr("upperdir", upper)
        setstr("workdir", work)
        for k, v in options.items():
            setstr(k, v)
        call(SYS_fsconfig, fs, FSCONFIG_CMD_CREATE, None, None, 0)
        mnt = call(SYS_fsmount, fs, 1, 0)
        try:
            call(SYS_move_mount, mnt, b"", -100, target.encode(), MOVE_MOUNT_F_EMPTY_PATH)
        finally:
            os.close(mnt)
    finally:
        os.close(fs)
