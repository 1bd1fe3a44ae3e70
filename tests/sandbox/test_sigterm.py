"""A `dojo` command stopped by SIGTERM cleans up the sandboxes it made."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys, time
    from codedojo.cli import exit_on_sigterm  # noqa: F401
    from codedojo.sandbox.base import SandboxSpec
    from codedojo.sandbox.local import LocalProvider
    from tests.sandbox.conftest import SMALL
    {setup}
    provider = LocalProvider(root=sys.argv[1])
    box = provider.create(SandboxSpec(image=sys.argv[2], limits=SMALL))
    print(box.id, flush=True)
    time.sleep(60)
""")


def stopped(provider, project, setup: str) -> tuple[int, str]:
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT.format(setup=setup), provider.root,
                             project], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    sandbox_id = proc.stdout.readline().strip()
    assert sandbox_id, "the sandbox was not made"
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=60), sandbox_id


def test_a_command_stopped_by_sigterm_leaves_no_sandbox(provider, project):
    rc, sandbox_id = stopped(provider, project, "exit_on_sigterm()")
    assert rc == 128 + signal.SIGTERM
    assert not os.path.exists(os.path.join(provider.sandboxes_dir, sandbox_id))


def test_without_it_the_sandbox_outlives_its_process(provider, project):
    """(What the handler is for: Python's default dies without its exit handlers.)"""
    rc, sandbox_id = stopped(provider, project, "pass")
    try:
        assert rc == -signal.SIGTERM
        assert os.path.exists(os.path.join(provider.sandboxes_dir, sandbox_id))
    finally:
        assert sandbox_id in provider.gc()
