"""Reading a TOML config file, with one error for whatever keeps it from being read, and
saying on one line which fields of what was read are wrong.

Every config of codedojo (a pretraining recipe, a bench recipe, an egress policy, a tool
environment, the rewards) is TOML; each loader validates the tables it gets and names the
field that is wrong (`field_errors`). `read_toml` is the step before: the file itself.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator


def read_toml(path: str | Path) -> dict[str, Any]:
    """The tables of the TOML file at ``path``; ValueError naming the file and what keeps it
    from being read: missing, a directory, unreadable, not UTF-8 text, not TOML (the line and
    column)."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: a directory, not a TOML file") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror or e})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not TOML ({e})") from None


_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def plain_name(name: str, max_length: int | None = 100) -> str:
    """``name`` when it can name a directory of its own (a run, a stage, a task): one path
    component, and neither "." nor "..", which name the directories around it; else a
    ValueError saying what such a name is."""
    if not _PLAIN.fullmatch(name) or (max_length is not None and len(name) > max_length):
        most = f", at most {max_length} characters" if max_length is not None else ""
        raise ValueError(f"{name!r} is not a plain name: letters, digits, '_', '.' and '-', "
                         f"starting with a letter or digit{most}")
    return name


PlainName = Annotated[str, AfterValidator(plain_name)]


def field_errors(errors: Iterable[Mapping[str, Any]], prefix: str = "") -> str:
    """Validation errors (pydantic's ``e.errors()``, or the list a FastAPI 422 answers) on one
    line: each field's dotted path after ``prefix``, and what is wrong with it."""
    return "; ".join(f"{prefix}{'.'.join(str(x) for x in err.get('loc', ()))}: {err.get('msg')}"
                     for err in errors)
