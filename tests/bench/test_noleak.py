"""The agent's sandbox holds no hidden tests, no gold patch and no git history."""

PRUNE = r"\( -path /proc -o -path /sys -o -path /dev -o -path /usr -o -path /opt/venv/lib \) -prune -o"


def test_agent_sandbox_has_no_hidden_tests_gold_patch_or_history(images, tiny_suite):
    for task in tiny_suite.tasks:
        sb = images.agent_sandbox(task)
        try:
            found = sb.exec(f"find / {PRUNE} \\( -name test_core.py -o -name tests -o -name .git "
                            f"-o -name '*.orig' -o -name '*.rej' -o -name '*.patch' -o -name '*.diff' \\) -print")
            # The sandbox user cannot read some system folders (/root): neither can the agent.
            denied = [ln for ln in found.stderr.splitlines() if ln and "Permission denied" not in ln]
            assert not denied, found.stderr
            assert found.stdout.strip() == "", found.stdout
            # Content search: a hidden test's name, and the gold patch's added lines.
            needles = ["test_parse_pair_keeps_later_equals"]
            needles += [ln[1:].strip() for ln in task.patch.splitlines()
                        if ln.startswith("+") and not ln.startswith("+++") and len(ln.strip()) > 8]
            for needle in needles:
                grep = sb.exec(["grep", "-rlF", "--exclude-dir=proc", "--exclude-dir=sys", "--exclude-dir=usr",
                                "--exclude-dir=dev", "--", needle, "/workspace", "/tmp", "/home", "/root", "/opt"])
                assert grep.stdout.strip() == "", f"{task.instance_id}: {needle!r} found in {grep.stdout}"
            assert "PKG-INFO" in sb.exec("ls /workspace").stdout  # the search did look at the tree
        finally:
            sb.destroy()
