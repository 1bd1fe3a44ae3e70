"""Every script under `benchmarks/` runs at its smallest size and prints what the README says it
prints: JSON lines, each naming its script (``bench``), with the figures its readers look for,
the checks it makes of itself holding (identical output, the same turns read back), and more
than 0 where a 0 would say it measured nothing (`POSITIVE`). The figures' values are timings of
a busy test machine and are not judged here. The scripts that
read a trained checkpoint read one from a whole pretraining run of a tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "benchmarks"
sys.path.insert(0, str(SCRIPTS))
from common import SKIPPED  # noqa: E402

HELPERS = {"common.py"}  # modules the scripts share, not benchmarks
RUN = "{run}"  # the tiny run's directory, filled in for the scripts that read a checkpoint

# script -> (its smallest arguments, keys every line it prints has, checks that must read true)
SMOKE: dict[str, tuple[list[str], set[str], set[str]]] = {
    "trajectory_store.py": (["--turns", "4", "--system", "50", "--reply", "10", "--tool", "20"],
                            {"ratio", "bytes_whole", "bytes_shared"},
                            {"same_turns", "same_records"}),
    "harness.py": (["--n", "3"], {"tool_rpc_ms_p50", "baseline_inprocess_ms_p50"}, set()),
    "routing.py": (["--layers", "2", "--dim", "32", "--experts", "4", "--top-k", "2",
                    "--batch", "2", "--prompt", "16", "--new", "4", "--repeats", "1",
                    "--turns", "2", "--tool", "8"],
                   {"plain_tok_s", "record_tok_s", "wire_b64_bytes"}, {"identical"}),
    "egress.py": (["--rate", "20", "--seconds", "0.3", "--concurrency", "2"],
                  {"added_ms_p50", "direct_p50_ms", "proxied_p50_ms"}, set()),
    "sandbox.py": (["--n", "2", "--concurrent", "2"], {"create_ms_p50", "fork_ms_p50"},
                   {"venv_works", "restore_ok"}),
    "bench_runner.py": (["--reps", "1"],
                        {"tasks_per_hour_1", "setup_ms_p50", "warmup_tasks_per_hour"}, set()),
    "stop_strings.py": (["--tokens", "20", "--rounds", "1"],
                        {"us_per_token_long", "us_per_token_short", "ratio"}, set()),
    "decode.py": (["--new-tokens", "4", "--batch1-prompts", "1", "--skip-bf16", "--skip-hf"],
                  {"batch1_tok_s", "bound_tok_s"}, set()),
    "load_memory.py": (["--model", f"{RUN}/final"],
                       {"model_mb", "extra_mb_build", "extra_mb_baseline"},
                       {"no_imports_measured"}),
    "prefix_cache.py": (["--turns", "2", "--tool-tokens", "16", "--reply", "2", "--group", "2",
                         "--group-prompt", "48"],
                        {"agent_speedup", "group_speedup"}, {"identical", "first_turn_cold"}),
    "train_throughput.py": (["--batch", "1", "--seq", "16", "--steps", "1", "--no-compile",
                             "--random-init"], {"ours_tok_s", "hf_tok_s", "ratio"}, set()),
    "mtp_distill_step.py": (["--steps", "1", "--no-compile", "--random-init", "--batch", "1",
                             "--seq-len", "32"],
                            {"forward_step_s", "stored_step_s", "speedup"}, set()),
    "spec_decode.py": (["--ckpt", f"{RUN}/final", "--data", f"{RUN}/data/eval",
                        "--prompts", "2", "--prompt-len", "8", "--new", "8"],
                       {"accept_first", "mean_accepted", "spec_tok_s", "plain_tok_s", "speedup",
                        "tokens_per_pass", "steady_machine", "accept_first_ci95",
                        "speedup_ci95", "draft_tokens_per_round"}, {"greedy_identical"}),
    "mtp_agreement.py": (["--ckpt", f"{RUN}/final", "--base", f"{RUN}/ckpt/sft",
                          "--data", f"{RUN}/data/eval", "--prompts", "2", "--prompt-len", "8",
                          "--new", "8"],
                         {"agree_depth1", "agree_depth2", "base_agree_depth1", "agree_depth1_ci95",
                          "outside_draft_vocab", "train_agree_depth1", "k2_accept_first"}, set()),
    "mtp_features.py": (["--ckpt", f"{RUN}/final", "--data", f"{RUN}/data/eval", "--layers",
                         "0", "--rows", "4", "--steps", "2", "--batch", "2", "--prompts", "2",
                         "--prompt-len", "8", "--new", "8"],
                        {"fused_agree_depth1", "baseline_agree_depth1", "gain_depth1"}, set()),
}

# script -> figures that must be more than 0 (a 0 says the run never reached what it measures)
POSITIVE: dict[str, set[str]] = {
    "decode.py": {"batch1_decode_tok_s"},  # a decode step after each prompt's first step
    "bench_runner.py": {"warmup_tasks_per_hour"},  # the untimed pass over the suite ran
    "stop_strings.py": {"held_chars_long", "held_chars_short"},  # the answer starts each stop
}


def test_every_benchmark_script_has_a_smoke_run():
    assert {p.name for p in SCRIPTS.glob("*.py")} - HELPERS == set(SMOKE)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A whole pretraining run of a tiny model (all five stages) with MTP modules as the
    recipe's: two, reading a lower layer's states too, drafting over a draft vocabulary."""
    from rich.console import Console

    from codedojo.model.tokenizer import load_tokenizer
    from codedojo.pretrain.trainer import run
    from tests.pretrain.tiny_run import five_stage_config

    cfg = five_stage_config(tmp_path_factory.mktemp("bench"), "tiny", n_mtp=2, mtp_taps=[0],
                            mtp_draft_vocab=512)
    run(cfg, tok=load_tokenizer(), console=Console(quiet=True))
    return Path(cfg.out_dir) / cfg.name


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMOKE))
def test_a_benchmark_runs_at_its_smallest_and_prints_its_figures(script, request):
    args, keys, checks = SMOKE[script]
    if any(RUN in a for a in args):
        run_dir = str(request.getfixturevalue("tiny_run"))
        args = [a.replace(RUN, run_dir) for a in args]
    done = subprocess.run([sys.executable, str(SCRIPTS / script), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert lines, f"{script} printed nothing"
    for line in lines:
        assert line.get("bench") == script.removesuffix(".py"), line  # a line names its script
        assert keys <= set(line), f"{script}: {sorted(keys - set(line))} missing from {line}"
        for check in checks:
            assert line[check] is True, f"{script}: {check} is {line[check]!r}"
        for key in POSITIVE.get(script, set()):
            assert line.get(key, 0) > 0, f"{script}: {key} is {line.get(key)!r}"


@pytest.mark.parametrize("script", ["spec_decode.py", "mtp_agreement.py", "mtp_features.py"])
def test_a_benchmark_without_its_checkpoint_is_skipped_and_says_what_makes_one(script, tmp_path):
    """Exit status 77 (`make bench` goes on past it), and the command that writes one."""
    done = subprocess.run([sys.executable, str(SCRIPTS / script), "--ckpt", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == SKIPPED == 77 and done.stdout == ""
    assert done.stderr.strip() == (f"{tmp_path}: no checkpoint; run `dojo pretrain "
                                   "configs/cpt-smollm2.toml` first")


@pytest.mark.parametrize("script", ["egress.py", "harness.py", "sandbox.py"])
def test_a_benchmark_that_needs_root_is_skipped_without_it(script):
    """Run as another user (its effective uid is not 0): exit status 77, which `make bench` goes
    on past, and the reason. (Its directory goes first on the import path, as for a script run
    by name.)"""
    not_root = ("import os, runpy, sys; os.geteuid = lambda: 1000; sys.argv = sys.argv[1:]; "
                "sys.path.insert(0, os.path.dirname(sys.argv[0])); "
                "runpy.run_path(sys.argv[0], run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", not_root, str(SCRIPTS / script)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == SKIPPED == 77 and done.stdout == ""
    assert done.stderr.strip() == f"benchmarks/{script}: needs root " + {
        "egress.py": "(network namespaces, iptables)",
        "harness.py": "(local sandboxes: mounts, cgroups, namespaces)",
        "sandbox.py": "(local sandboxes: mounts, cgroups, namespaces)"}[script]


@pytest.mark.slow
def test_decode_refuses_too_few_new_tokens_to_leave_a_decode_step():
    """Two tokens end in the first step: no decode step to time, refused (not a 0 tok/s)."""
    done = subprocess.run([sys.executable, str(SCRIPTS / "decode.py"), "--new-tokens", "2",
                           "--batch1-prompts", "1", "--skip-bf16", "--skip-hf"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert "--new-tokens 2: every request ended in its first step" in done.stderr
