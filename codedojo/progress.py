"""Progress of a long job. On a terminal (or in a notebook), rich's live bars. Anywhere else (``nohup``, a Slurm or
torchrun log, CI) rich draws a bar only once it is finished, so a stage of hours would print
nothing until its end: there a task prints one plain line every minute instead (every
``$CODEDOJO_PROGRESS_EVERY`` seconds when set), and one when it ends."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

EVERY_S = 60.0


def progress(console: Any, *columns: Any) -> Any:
    """A with-block that tracks tasks (``add_task``, ``update``): `rich.progress.Progress` with
    these columns on a terminal or in a notebook (live either way), `LineProgress` elsewhere."""
    if console.is_terminal or getattr(console, "is_jupyter", False):
        from rich.progress import Progress

        return Progress(*columns, console=console, transient=False)
    return LineProgress(console, every=progress_every())


def progress_every() -> float:
    """Seconds between a task's lines where there are no live bars: ``$CODEDOJO_PROGRESS_EVERY``
    when set (ValueError naming it unless a positive number), else `EVERY_S`."""
    every = os.environ.get("CODEDOJO_PROGRESS_EVERY")
    if every is None:
        return EVERY_S
    try:
        value = float(every)
    except ValueError:
        value = math.nan
    if not (0 < value < math.inf):
        raise ValueError(f"CODEDOJO_PROGRESS_EVERY={every!r}: not a positive number of seconds")
    return value


@dataclass
class _Task:
    description: str
    total: float | None
    completed: float
    fields: dict[str, Any]
    started: float
    start_completed: float
    printed: float = field(default=float("-inf"))  # when its last line was printed
    ended: bool = False


class LineProgress:
    """rich's ``Progress`` interface as lines: ``bulk: 120/500 (24%) loss 3.052, 0:04:12 elapsed,
    about 0:13:18 left``. A line is due at most every ``every`` seconds per task, and once when
    the task completes or the block ends."""

    def __init__(self, console: Any, every: float = EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < every < math.inf:  # nan and inf too: a job that never says where it is
            raise ValueError(f"every: {every} is not a positive number of seconds")
        self.console, self.every, self.clock = console, every, clock
        self.tasks: list[_Task] = []

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        for t in self.tasks:
            if not t.ended:
                self._print(t)

    def add_task(self, description: str, total: float | None = None, completed: float = 0,
                 **fields: Any) -> int:
        now = self.clock()
        self.tasks.append(_Task(description, total, completed, fields, now, completed,
                                printed=now))  # the first line comes a period in
        return len(self.tasks) - 1

    def update(self, task_id: int, *, completed: float | None = None,
               advance: float | None = None, **fields: Any) -> None:
        t = self.tasks[task_id]
        if completed is not None:
            t.completed = completed
        if advance is not None:
            t.completed += advance
        t.fields.update(fields)
        if t.total is not None and t.completed >= t.total and not t.ended:
            self._print(t)
            t.ended = True
        elif self.clock() - t.printed >= self.every:
            self._print(t)

    def reset(self, task_id: int, *, completed: float = 0) -> None:
        """The task starts again at ``completed``, now (as rich's ``Progress.reset``): a job that
        goes on from where it stopped counts its time left from what it does from here."""
        t = self.tasks[task_id]
        t.completed = t.start_completed = completed
        t.started = self.clock()
        t.ended = False

    def _print(self, t: _Task) -> None:
        now = self.clock()
        t.printed = now
        elapsed = now - t.started
        parts = [f"{t.description}: {_count(t.completed)}"]
        if t.total:
            parts[0] += f"/{_count(t.total)} ({100 * t.completed / t.total:.0f}%)"
        parts += [f"{k} {v}" for k, v in t.fields.items()]
        line = " ".join(parts) + f", {_clock(elapsed)} elapsed"
        done = t.completed - t.start_completed
        if t.total and 0 < done and t.completed < t.total:
            line += f", about {_clock(elapsed / done * (t.total - t.completed))} left"
        self.console.print(line, markup=False, highlight=False)


def _count(x: float) -> str:
    return f"{x:g}"


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
