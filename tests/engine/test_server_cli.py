"""`dojo serve` as a user runs it: a subprocess that prints its URL once ready, then answers.
The checkpoint carries MTP modules, so it decodes speculatively: the model in float32, its drafts
in bfloat16."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading

import httpx
import torch

from codedojo.model.config import ModelConfig
from codedojo.model.hf import save_hf
from codedojo.model.mtp import MTP, save_mtp
from codedojo.model.tokenizer import tiny_tokenizer
from codedojo.model.transformer import Transformer


def test_dojo_serve_prints_url_and_serves(tmp_path):
    tok = tiny_tokenizer()
    cfg = ModelConfig.tiny(vocab_size=tok.vocab_size, max_seq_len=128)
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights()
    save_hf(model, cfg, tmp_path / "m")
    tok.save(tmp_path / "m")
    mtp = MTP(cfg, 2, draft_vocab=32)
    mtp.set_draft_vocab(torch.arange(cfg.vocab_size, dtype=torch.float))
    save_mtp(mtp, tmp_path / "m")

    cmd = [sys.executable, "-c", "from codedojo.cli import main; main()", "serve", "--model", str(tmp_path / "m"),
           "--port", "0", "--max-batch", "2", "--served-name", "tiny", "--draft-dtype", "bfloat16"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        url, seen = None, []
        while url is None:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                assert proc.poll() is None, f"dojo serve exited early: {''.join(seen)}"
                continue
            seen.append(line)
            if line.startswith("Serving tiny at "):
                url = line.split(" at ", 1)[1].strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        assert "Speculative decoding with 2 MTP modules (bfloat16 drafts)\n" in seen, seen
        with httpx.Client(timeout=60) as http:
            r = http.post(url + "/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
            assert http.post(url + "/chat/completions", json={"model": "tiny", "messages": []}).status_code == 400
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_dojo_serve_names_a_bad_dtype():
    from typer.testing import CliRunner

    from codedojo.cli import app

    r = CliRunner().invoke(app, ["serve", "--dtype", "float16"])
    assert r.exit_code == 2 and "--dtype" in r.output and "float16" in r.output
    r = CliRunner().invoke(app, ["serve", "--draft-dtype", "fp8"])
    assert r.exit_code == 2 and "--draft-dtype" in r.output and "fp8" in r.output


def test_dojo_serve_names_a_negative_prefix_cache():
    from typer.testing import CliRunner

    from codedojo.cli import app

    r = CliRunner().invoke(app, ["serve", "--prefix-cache-tokens", "-1"])
    assert r.exit_code == 2 and "--prefix-cache-tokens" in r.output


def test_dojo_serve_names_a_model_without_weights_and_a_port_taken(tmp_path):
    """A directory with a tokenizer but no weights, and a port another server listens on: one
    line naming it, exit status 2, no traceback."""
    import socket

    from typer.testing import CliRunner

    from codedojo.cli import app

    tok = tiny_tokenizer()
    tok.save(tmp_path / "tok")
    r = CliRunner().invoke(app, ["serve", "--model", str(tmp_path / "tok")],
                           env={"COLUMNS": "300"})
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output
    assert "--model" in r.output and "config.json not found" in r.output

    cfg = ModelConfig.tiny(vocab_size=tok.vocab_size, max_seq_len=128)
    save_hf(Transformer(cfg), cfg, tmp_path / "m")
    tok.save(tmp_path / "m")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # in a process of its own: `serve` sets the process's SIGTERM handler
        r = subprocess.run([sys.executable, "-c", "from codedojo.cli import main; main()",
                            "serve", "--model", str(tmp_path / "m"), "--port", str(port)],
                           capture_output=True, text=True, timeout=300,
                           env={**os.environ, "COLUMNS": "300"})
    assert r.returncode == 2, r.stderr
    assert f"could not listen on 127.0.0.1:{port}" in r.stderr and "Traceback" not in r.stderr


def test_dojo_serve_names_a_checkpoint_whose_weights_or_mtp_modules_do_not_load(tmp_path):
    """Weights or MTP modules cut short, an mtp.json not as written: one line naming the
    directory and the file, exit status 2, no traceback."""
    import json
    import shutil

    from typer.testing import CliRunner

    from codedojo.cli import app

    tok = tiny_tokenizer()
    cfg = ModelConfig.tiny(vocab_size=tok.vocab_size, max_seq_len=128)
    good = tmp_path / "good"
    save_hf(Transformer(cfg), cfg, good)
    tok.save(good)
    save_mtp(MTP(cfg, 2), good)

    def cut(name):
        return lambda d: (d / name).write_bytes((d / name).read_bytes()[:100])

    for i, (spoil, said) in enumerate([
        (cut("model.safetensors"), ".safetensors weights do not load"),
        (cut("mtp.safetensors"), "MTP modules (mtp.json, mtp.safetensors) do not load"),
        (lambda d: (d / "mtp.json").write_text(json.dumps({"depth": "x"})),
         "MTP modules (mtp.json, mtp.safetensors) do not load: ValueError"),
    ]):
        bad = tmp_path / f"bad{i}"
        shutil.copytree(good, bad)
        spoil(bad)
        r = CliRunner().invoke(app, ["serve", "--model", str(bad), "--port", "0"],
                               env={"COLUMNS": "300"})
        assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (i, r.output)
        assert "--model" in r.output and f"{bad}: " in r.output and said in r.output, r.output
