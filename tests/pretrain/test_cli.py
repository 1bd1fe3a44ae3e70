"""`dojo pretrain` as a user runs it: what it cannot use is named on one line (exit status 2),
before the data is prepared where it can be; a failure of its own keeps its traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from codedojo.cli import app
from tests.pretrain.tiny_run import code_corpus

CONFIG = """\
name = "r"
out_dir = "{out}"
sft_examples = 6
long_docs_chars = [500, 3000]

[model]
base = "tiny"
n_mtp = 1
tiny_overrides = {{ vocab_size = 49152, dim = 32, n_heads = 2, n_kv_heads = 1, ffn_dim = 64 }}

[corpus]
holdout_frac = 0.25
dedup = {{ near = false }}

[[corpus.sources]]
kind = "dir"
path = "{src}"

[eval]
seq_len = 32
batch_size = 2
batches = 1
probe_len = 96
probe_trials = 1

[[stages]]
name = "bulk"
seq_len = 32
batch_size = 2
steps = 2
lr = 1e-3
mix = [{{ data = "code" }}]
"""


@pytest.fixture
def config(tmp_path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(CONFIG.format(out=tmp_path / "runs", src=code_corpus(tmp_path / "src")))
    return path


def pretrain(*args: str, **env: str):
    return CliRunner().invoke(app, ["pretrain", *args], env={"COLUMNS": "80", **env})


def refused(r, said: str) -> None:
    """Exit status 2, and the last line (one line, however long) says ``said``."""
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output
    assert "Traceback" not in r.output and r.output.splitlines()[-1].startswith(said), r.output


@pytest.mark.parametrize("setting, said", [
    ("model.base=nosuchmodel", "error: model 'nosuchmodel': not 'smollm2-135m-instruct'"),
    ("model.mtp_taps=[0, 50]", "error: taps: [0, 50] must be increasing layer indexes in [0, 2)"),
    ("model.tiny_overrides.dim=-4",
     "error: ModelConfig: dim: Input should be greater than or equal to 1"),
])
def test_a_model_it_cannot_make_is_named_before_the_data(config, setting, said):
    r = pretrain(str(config), "--set", setting)
    refused(r, said)
    assert "preparing data" not in r.output
    assert not (config.parent / "runs" / "r" / "data").exists()


@pytest.mark.parametrize("setting, said", [
    ("corpus.sources.0.path={tmp}/nosuch", "error: corpus.sources[0].path: {tmp}/nosuch does not"),
    ("sft_jsonl={tmp}/nosuch.jsonl", "error: sft_jsonl: {tmp}/nosuch.jsonl does not exist"),
])
def test_a_file_the_data_is_made_from_is_named_before_any_is_read(config, setting, said):
    tmp = config.parent
    refused(pretrain(str(config), "--set", setting.format(tmp=tmp)), said.format(tmp=tmp))
    assert not (tmp / "runs" / "r" / "data" / "train").exists()


@pytest.mark.parametrize("every", ["0", "abc", "-5", "nan", "inf"])
def test_a_bad_progress_period_is_named_before_the_data(config, every):
    r = pretrain(str(config), CODEDOJO_PROGRESS_EVERY=every)
    refused(r, f"error: CODEDOJO_PROGRESS_EVERY={every!r}: not a positive number of seconds")
    assert "preparing data" not in r.output


def test_a_refused_resume_is_not_said_to_be_about_from(config, tmp_path):
    """A run whose data was made under other settings: without --from the refusal is the
    resume's; with it, the branch's."""
    from codedojo.pretrain.config import load_config

    run_dir = tmp_path / "runs" / "r"
    (run_dir / "data").mkdir(parents=True)
    (run_dir / "config.json").write_text(load_config(config).model_dump_json())
    (run_dir / "data" / "done.json").write_text(json.dumps({}))
    refused(pretrain(str(config), "--set", "corpus.holdout_frac=0.5"),
            f"resume: {run_dir}: this run was started with other corpus")
    refused(pretrain(str(config), "--set", "corpus.holdout_frac=0.5", "--out-dir",
                     str(tmp_path / "b"), "--from", str(tmp_path / "nosuch")), "--from: ")


def test_a_failure_of_its_own_keeps_its_traceback(config, monkeypatch):
    import codedojo.pretrain.trainer as trainer

    def broken(*args, **kwargs):
        raise RuntimeError("a fault of the trainer")

    monkeypatch.setattr(trainer, "run", broken)
    r = pretrain(str(config))
    assert isinstance(r.exception, RuntimeError) and r.exit_code == 1


def test_a_value_error_deep_in_the_run_is_one_line_with_its_traceback_kept(config, monkeypatch,
                                                                            tmp_path):
    """A ValueError may be a setting the run cannot use or a fault of the trainer's: the line
    says it, and the run's folder keeps the traceback."""
    import codedojo.pretrain.trainer as trainer

    def broken(cfg, **kwargs):
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        raise ValueError("a shape that does not fit")

    monkeypatch.setattr(trainer, "run", broken)
    r = pretrain(str(config))
    error = tmp_path / "runs" / "r" / "error.txt"
    refused(r, f"error: a shape that does not fit (traceback: {error})")
    assert "Traceback" in error.read_text()
    assert "a shape that does not fit" in error.read_text()
