"""Problem statements written from symptoms only.

A statement may show a failing scenario's name, the error it raised, or a log of a scenario
run; it never names the file or line of the bug, nor the fix. The only statement that names a
function is the feature request, because naming what to build is the request itself.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta

# A failure message can carry paths (the build's scratch tree, the package's files) and line
# numbers: each becomes <source>, so no statement says where the bug is.
_PATH = re.compile(r"(?:[\w.\-]*/)*[\w.\-]+\.py(?::\d+|(\"?),? line \d+)?")


# An object's address in its repr (`<function f at 0x7f3b87297ce0>`): another each run.
_ADDRESS = re.compile(r"(?<= at )0x[0-9a-fA-F]+\b")


def clean_message(msg: str, max_lines: int = 6) -> str:
    """A failure's message as a statement shows it: the first lines, source paths as
    ``<source>``, and objects' addresses as ``0x...`` (so that building a recipe again writes
    the same text)."""
    lines = [_ADDRESS.sub("0x...", _PATH.sub(lambda m: "<source>" + (m.group(1) or ""), ln))
             .rstrip() for ln in msg.splitlines() if ln.strip()]
    return "\n".join(lines[:max_lines])


def bugfix_statement(package: str, failing: Mapping[str, str], rng: random.Random, show: int = 4) -> str:
    names = sorted(failing)
    rng.shuffle(names)
    shown = sorted(names[:show])
    parts = [
        f"After a recent change, `{package}` misbehaves: some scenarios from our regression suite "
        f"now fail ({len(failing)} in total). The suite itself is not part of this checkout.",
        "",
    ]
    for name in shown:
        parts.append(f"Scenario `{name}` fails with:")
        parts.append("```")
        parts.append(clean_message(failing[name]) or "(no message)")
        parts.append("```")
    if len(failing) > len(shown):
        parts.append(f"…and {len(failing) - len(shown)} more failing scenario(s).")
    parts += ["", "Find the cause in the library and fix it, keeping its other behaviour unchanged."]
    return "\n".join(parts)


def log_statement(
    package: str,
    outcomes: Mapping[str, str],
    messages: Mapping[str, str],
    rng: random.Random,
    max_ok_lines: int = 150,
) -> str:
    """JSON log lines of a scenario run against the buggy package: mostly noise, a few errors."""
    failed = sorted(t for t, o in outcomes.items() if o in ("failed", "error"))
    ok = sorted(t for t, o in outcomes.items() if o == "passed")
    if len(ok) > max_ok_lines:
        ok = sorted(rng.sample(ok, max_ok_lines))
    scenarios = failed + ok
    rng.shuffle(scenarios)
    t = datetime(2026, 3, 14, 2, 0, 0, tzinfo=UTC) + timedelta(seconds=rng.randint(0, 3600))
    run_id = f"{rng.getrandbits(32):08x}"
    lines: list[dict[str, object]] = [
        {"level": "INFO", "logger": "nightly", "event": "run.start", "run_id": run_id,
         "package": package, "scenarios": len(outcomes)},
    ]
    for i, name in enumerate(scenarios):
        t += timedelta(milliseconds=rng.randint(3, 400))
        status = "failed" if name in messages or name in failed else "ok"
        rec: dict[str, object] = {"level": "ERROR" if status == "failed" else "INFO",
                                  "logger": "nightly.scenario", "event": "scenario.finished",
                                  "run_id": run_id, "scenario": name, "status": status,
                                  "duration_ms": rng.randint(1, 120)}
        if status == "failed":
            rec["error"] = clean_message(messages.get(name, ""), max_lines=3).replace("\n", " | ")
        lines.append({"ts": t.isoformat(timespec="milliseconds"), **rec})
        if i % 37 == 36:
            lines.append({"ts": t.isoformat(timespec="milliseconds"), "level": "DEBUG", "logger": "nightly.worker",
                          "event": "worker.heartbeat", "run_id": run_id, "rss_mb": rng.randint(40, 90)})
    lines.append({"ts": (t + timedelta(milliseconds=50)).isoformat(timespec="milliseconds"), "level": "WARNING",
                  "logger": "nightly", "event": "run.finished", "run_id": run_id,
                  "failed": len(failed), "passed": len(outcomes) - len(failed)})
    if "ts" not in lines[0]:
        lines[0] = {"ts": lines[1]["ts"] if len(lines) > 1 else t.isoformat(), **lines[0]}
    body = "\n".join(json.dumps(rec, sort_keys=False) for rec in lines)
    return (
        f"Our nightly scenario run against `{package}` started failing after the last change to "
        f"the library. Nobody has looked at it yet; below is the run's log ({len(lines)} JSON "
        "lines). Investigate, find the cause in the library and fix it.\n\n```jsonl\n" + body + "\n```"
    )


def feature_statement(module: str, qualname: str, signature: str, docstring: str) -> str:
    doc = docstring.strip()  # (the text within the quotes: a quote at either end is content)
    return (
        f"`{module}.{qualname}` is declared but not implemented yet: calling it raises "
        f"NotImplementedError. Implement it so it behaves as documented.\n\n"
        f"Signature: `{qualname}{signature}`\n\nDocumentation:\n\n{doc}\n"
    )
