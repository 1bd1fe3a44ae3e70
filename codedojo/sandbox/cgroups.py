"""Per-sandbox cgroups: memory, pids and cpu limits, and a kill that nothing escapes.

Both cgroup layouts are detected at runtime. v2 (a single hierarchy with `cgroup.controllers`)
uses memory.max / pids.max / cpu.max and `cgroup.kill`. v1 (one hierarchy per controller, as on
this project's CI) uses memory.limit_in_bytes (+ memsw when present), pids.max, cpu.cfs_quota_us
and the freezer to stop every task before killing it, so a fork loop cannot outrun the kill.

On v1 a sandbox's cgroup goes under `<cgroup of this process>/codedojo/<id>` when that is
writable, else under `/codedojo/<id>` at the hierarchy's root. On v2 a cgroup that holds
processes cannot pass controllers to its children (the kernel answers EBUSY), and this
process's own cgroup holds this process: there `codedojo/` goes beside it (in its parent,
which systemd's slices and scopes leave free of processes), else at the root; where neither
can have the controllers, creating the manager says why.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from dataclasses import dataclass

CGROUP_FS = "/sys/fs/cgroup"
V1_CONTROLLERS = ("memory", "pids", "cpu", "freezer")
V2_CONTROLLERS = ("memory", "pids", "cpu")
FREEZE_TIMEOUT_S = 5.0  # how long a snapshot waits for the sandbox's tasks to stop


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _own_cgroups() -> dict[str, str]:
    """controller (or "" for v2) -> this process's cgroup path."""
    out: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            for c in ctrls.split(",") if ctrls else [""]:
                out[c] = path
    return out


def is_v2() -> bool:
    return os.path.exists(os.path.join(CGROUP_FS, "cgroup.controllers"))


def _base_dir(hierarchy: str, own: str) -> str:
    """The `codedojo` parent directory inside `hierarchy`: below our own cgroup if writable."""
    for parent in (os.path.join(hierarchy, own.lstrip("/")), hierarchy):
        base = os.path.join(parent, "codedojo")
        try:
            os.makedirs(base, exist_ok=True)
            return base
        except OSError:
            continue
    raise OSError(errno.EACCES, f"no writable cgroup directory in {hierarchy}")


def _v2_base(own: str) -> str:
    """The v2 `codedojo` directory: beside this process's cgroup, or at the root; the first
    where every one of `V2_CONTROLLERS` can be passed down to the sandboxes' cgroups."""
    own_dir = os.path.normpath(os.path.join(CGROUP_FS, own.lstrip("/")))
    why: list[str] = []
    # (not in our own cgroup, which holds this process: the kernel would refuse, EBUSY)
    for parent in dict.fromkeys((os.path.dirname(own_dir) if own_dir != CGROUP_FS
                                 else own_dir, CGROUP_FS)):
        base = os.path.join(parent, "codedojo")
        made = not os.path.isdir(base)
        try:
            os.makedirs(base, exist_ok=True)
        except OSError as e:
            why.append(f"{base}: {e.strerror}")
            continue
        errors = _enable(base)
        if not errors:
            return base
        why.append(f"{base}: " + "; ".join(errors))
        if made:
            with contextlib.suppress(OSError):
                os.rmdir(base)
    raise OSError(errno.EBUSY, "cgroup v2: no cgroup where sandboxes can have the "
                  f"{', '.join(V2_CONTROLLERS)} controllers ({' | '.join(why)}). A cgroup "
                  "with processes cannot pass controllers down: run codedojo in a cgroup of its "
                  "own whose parent has none (`systemd-run --scope -p Delegate=yes ...`), or, in "
                  "a container, first move its processes into a child cgroup")


def _enable(base: str) -> list[str]:
    """Enable `V2_CONTROLLERS` in the subtree_control of every cgroup from the hierarchy's root
    down to ``base``, so that ``base``'s children have them; what failed where, if any."""
    chain = [base]
    while chain[-1] != CGROUP_FS and os.path.dirname(chain[-1]) != chain[-1]:
        chain.append(os.path.dirname(chain[-1]))
    errors: dict[str, str] = {}
    for d in reversed(chain):
        f = os.path.join(d, "cgroup.subtree_control")
        for c in V2_CONTROLLERS:
            try:
                _write(f, f"+{c}")
            except OSError as e:  # EBUSY: `d` holds processes; ENOENT/EINVAL: not offered
                errors.setdefault(c, f"{c} in {d}: {e.strerror}")
    with open(os.path.join(base, "cgroup.subtree_control")) as fh:
        have = fh.read().split()
    return [errors.get(c, f"{c}: not enabled") for c in V2_CONTROLLERS if c not in have]


@dataclass
class Cgroup:
    """The cgroup directories of one sandbox (one per v1 controller, or one on v2)."""

    dirs: dict[str, str]  # controller ("v2" for the unified hierarchy) -> directory
    v2: bool

    @property
    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs.values()]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for f in self.procs_files:
            with contextlib.suppress(OSError), open(f) as fh:
                found.update(int(x) for x in fh.read().split())
        return found

    def memory_events(self) -> dict[str, int]:
        """Counters that tell an OOM kill happened (v1: failcnt/oom_kill, v2: memory.events)."""
        out: dict[str, int] = {}
        if self.v2:
            with contextlib.suppress(OSError), open(os.path.join(self.dirs["v2"], "memory.events")) as f:
                for line in f:
                    k, v = line.split()
                    out[k] = int(v)
        elif "memory" in self.dirs:
            with contextlib.suppress(OSError), open(
                os.path.join(self.dirs["memory"], "memory.oom_control")
            ) as f:
                for line in f:
                    k, v = line.split()
                    out[k] = int(v)
        return out

    def kill(self, timeout: float = 5.0) -> None:
        """Kill every task in the cgroup and wait until it is empty."""
        deadline = time.monotonic() + timeout
        if self.v2:
            with contextlib.suppress(OSError):
                _write(os.path.join(self.dirs["v2"], "cgroup.kill"), "1")
        freezer = self.dirs.get("freezer")
        while True:
            pids = self.pids()
            if not pids:
                return
            if freezer:
                with contextlib.suppress(OSError):
                    _write(os.path.join(freezer, "freezer.state"), "FROZEN")
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if freezer:
                with contextlib.suppress(OSError):
                    _write(os.path.join(freezer, "freezer.state"), "THAWED")
            if time.monotonic() > deadline:
                raise TimeoutError(f"cgroup still has tasks {sorted(pids)}")
            time.sleep(0.002)

    def remove(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        for d in self.dirs.values():
            while os.path.isdir(d):
                try:
                    os.rmdir(d)
                except OSError as e:
                    # EBUSY: exiting tasks still being accounted; the kill already happened.
                    if e.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise
                    time.sleep(0.002)

    def freeze(self, frozen: bool, timeout: float | None = None) -> None:
        """Pause every task (used to take a consistent snapshot), and wait until they all are:
        the kernel freezes asynchronously (v1 reads FREEZING, v2's `cgroup.events` says
        `frozen 0`, until the last task stops)."""
        if self.v2:
            _write(os.path.join(self.dirs["v2"], "cgroup.freeze"), "1" if frozen else "0")
        elif "freezer" in self.dirs:
            _write(os.path.join(self.dirs["freezer"], "freezer.state"), "FROZEN" if frozen else "THAWED")
        else:
            return
        timeout = FREEZE_TIMEOUT_S if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while frozen and not self._frozen():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the sandbox's tasks did not all stop within {timeout} s")
            time.sleep(0.002)

    def _frozen(self) -> bool:
        if self.v2:
            with open(os.path.join(self.dirs["v2"], "cgroup.events")) as f:
                return "frozen 1" in f.read().splitlines()
        with open(os.path.join(self.dirs["freezer"], "freezer.state")) as f:
            return f.read().strip() == "FROZEN"


class CgroupManager:
    """Creates sandbox cgroups with limits; finds the ones a crashed process left behind."""

    def __init__(self) -> None:
        self.v2 = is_v2()
        own = _own_cgroups()
        self.bases: dict[str, str] = {}
        if self.v2:
            self.bases["v2"] = _v2_base(own.get("", "/"))
        else:
            for c in V1_CONTROLLERS:
                hierarchy = os.path.join(CGROUP_FS, c)
                if os.path.isdir(hierarchy):
                    self.bases[c] = _base_dir(hierarchy, own.get(c, "/"))

    def create(self, name: str, memory_mb: int, pids: int, cpus: float) -> Cgroup:
        dirs: dict[str, str] = {}
        try:
            for c, base in self.bases.items():
                d = os.path.join(base, name)
                os.mkdir(d)
                dirs[c] = d
            cg = Cgroup(dirs, self.v2)
            self.set_limits(cg, memory_mb, pids, cpus)
            return cg
        except OSError:
            for d in dirs.values():
                with contextlib.suppress(OSError):
                    os.rmdir(d)
            raise

    def set_limits(self, cg: Cgroup, memory_mb: int, pids: int, cpus: float) -> None:
        """Write the limits (also on a cgroup that already holds tasks: a pooled sandbox)."""
        dirs = cg.dirs
        mem = str(memory_mb << 20)
        period = 100_000
        quota = str(max(1000, int(cpus * period)))
        if self.v2:
            d = dirs["v2"]
            _write(os.path.join(d, "memory.max"), mem)
            with contextlib.suppress(OSError):
                _write(os.path.join(d, "memory.swap.max"), "0")
            _write(os.path.join(d, "pids.max"), str(pids))
            _write(os.path.join(d, "cpu.max"), f"{quota} {period}")
            return
        if "memory" in dirs:
            memsw = os.path.join(dirs["memory"], "memory.memsw.limit_in_bytes")
            limit = os.path.join(dirs["memory"], "memory.limit_in_bytes")
            # memsw must stay >= the memory limit: order the two writes by direction.
            with open(limit) as f:
                lowering = int(f.read()) > int(mem)
            if os.path.exists(memsw) and lowering:
                _write(limit, mem)
                _write(memsw, mem)
            elif os.path.exists(memsw):
                _write(memsw, mem)
                _write(limit, mem)
            else:
                _write(limit, mem)
        if "pids" in dirs:
            _write(os.path.join(dirs["pids"], "pids.max"), str(pids))
        if "cpu" in dirs:
            _write(os.path.join(dirs["cpu"], "cpu.cfs_period_us"), str(period))
            _write(os.path.join(dirs["cpu"], "cpu.cfs_quota_us"), quota)

    def existing(self) -> dict[str, Cgroup]:
        """Sandbox cgroups present under our bases (name -> cgroup), for garbage collection."""
        names: dict[str, dict[str, str]] = {}
        for c, base in self.bases.items():
            with contextlib.suppress(OSError):
                for name in os.listdir(base):
                    d = os.path.join(base, name)
                    if os.path.isdir(d):
                        names.setdefault(name, {})[c] = d
        return {n: Cgroup(d, self.v2) for n, d in names.items()}
