"""Progress in a log file: a plain line every period and one at the end, where rich would draw
its bar only once the job is done."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rich.progress import Progress

from codedojo.progress import LineProgress, progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def log_console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=200), out


def test_a_log_gets_a_line_a_period_and_one_at_the_end():
    console, out = log_console()
    clock = Clock()
    with LineProgress(console, every=60, clock=clock) as prog:
        task = prog.add_task("bulk", total=500, loss="-")
        for step in range(1, 501):
            clock.now += 1.0  # a second a step
            prog.update(task, completed=step, loss=f"{5 - step / 250:.3f}")
    lines = out.getvalue().splitlines()
    assert len(lines) == 9  # at 60, 120, ..., 480 s, and the last step
    assert lines[0] == "bulk: 60/500 (12%) loss 4.760, 0:01:00 elapsed, about 0:07:20 left"
    assert lines[-1] == "bulk: 500/500 (100%) loss 3.000, 0:08:20 elapsed"


def test_a_resumed_task_counts_its_rate_from_where_it_resumed():
    console, out = log_console()
    clock = Clock()
    with LineProgress(console, every=30, clock=clock) as prog:
        task = prog.add_task("sft", total=1000, completed=900)
        clock.now += 30
        prog.update(task, advance=10)
        clock.now += 5
        prog.update(task, advance=10)  # within the period: no line
    lines = out.getvalue().splitlines()
    # 10 steps in 30 s: the 90 left take 270 s; at the end, 20 in 35 s: the 80 left 140 s
    assert lines == ["sft: 910/1000 (91%), 0:00:30 elapsed, about 0:04:30 left",
                     "sft: 920/1000 (92%), 0:00:35 elapsed, about 0:02:20 left"]


def test_a_reset_task_counts_its_time_left_from_where_it_was_reset():
    """A job that learns only once started that it goes on from where it stopped (a resumed
    generation) resets its task there, as rich's ``Progress.reset``: the time already spent
    and the jump do not enter its rate."""
    console, out = log_console()
    clock = Clock()
    with LineProgress(console, every=30, clock=clock) as prog:
        task = prog.add_task("gen", total=1000)
        clock.now += 20  # reading what was done
        prog.reset(task, completed=600)
        clock.now += 40
        prog.update(task, completed=640)
    # 40 in 40 s since the reset: the 360 left take 360 s (a line then, one at the end)
    assert out.getvalue().splitlines() == [
        "gen: 640/1000 (64%), 0:00:40 elapsed, about 0:06:00 left"] * 2


def test_a_task_without_a_total_and_an_error_in_the_block():
    console, out = log_console()
    clock = Clock()
    with pytest.raises(KeyboardInterrupt), LineProgress(console, every=60, clock=clock) as prog:
        task = prog.add_task("prompts")
        clock.now += 61
        prog.update(task, advance=64)
        raise KeyboardInterrupt  # the last line still says how far it got
    assert out.getvalue().splitlines() == ["prompts: 64, 0:01:01 elapsed"] * 2
    with pytest.raises(ValueError, match="every: 0 is not a positive"):
        LineProgress(console, every=0)


def test_a_terminal_gets_rich_bars_and_a_file_gets_lines(monkeypatch):
    assert isinstance(progress(Console(file=io.StringIO(), force_terminal=True)), Progress)
    assert isinstance(progress(Console(file=io.StringIO(), force_jupyter=True)), Progress)
    monkeypatch.delenv("CODEDOJO_PROGRESS_EVERY", raising=False)
    assert progress(log_console()[0]).every == 60
    monkeypatch.setenv("CODEDOJO_PROGRESS_EVERY", "5")
    assert progress(log_console()[0]).every == 5
    for bad in ("soon", "-1", "nan", "inf"):
        monkeypatch.setenv("CODEDOJO_PROGRESS_EVERY", bad)
        with pytest.raises(ValueError, match=f"CODEDOJO_PROGRESS_EVERY='{bad}': not a positive"):
            progress(log_console()[0])
