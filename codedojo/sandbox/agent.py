"""Build the C init helper (agent.c) on first use, cached by the hash of its source.

The helper is compiled by the project itself (gcc is part of the system setup), so there is no
binary in the tree and no extra install step: the first sandbox a store creates pays ~0.3 s.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import uuid
from pathlib import Path

from codedojo.sandbox.base import SandboxError

SOURCE = Path(__file__).with_name("agent.c")


def agent_binary(store_root: str) -> str:
    src = SOURCE.read_bytes()
    digest = hashlib.sha256(src).hexdigest()[:16]
    out_dir = os.path.join(store_root, "bin")
    out = os.path.join(out_dir, f"codedojo-sandbox-init-{digest}")
    if os.path.exists(out):
        return out
    os.makedirs(out_dir, exist_ok=True)
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise SandboxError("no C compiler found to build the sandbox init helper (install gcc)")
    tmp = f"{out}.{uuid.uuid4().hex}"
    run = subprocess.run([cc, "-O2", "-Wall", "-o", tmp, str(SOURCE)], capture_output=True, text=True)
    if run.returncode != 0:
        raise SandboxError(f"building the sandbox init helper failed: {run.stderr.strip()}")
    os.rename(tmp, out)  # atomic: concurrent builders all end with the same file
    return out
