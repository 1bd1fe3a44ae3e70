"""The pretraining loop data-parallel under torchrun: FSDP2 over gloo, two CPU processes (the
same code path as NCCL on GPUs, where only the backend differs)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from codedojo.data.features import TokenFeatures
from codedojo.data.shards import TokenShards
from codedojo.model.weights import load_model
from codedojo.pretrain.checkpoint import load_trainer_state, load_weights
from codedojo.pretrain.config import PretrainConfig
from codedojo.pretrain.optim import build_adamw
from codedojo.pretrain.selfgen import prompt_windows
from codedojo.pretrain.trainer import build_model
from tests.pretrain.fsdp_job import digest
from tests.pretrain.tiny_run import five_stage_config

ROOT = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path) -> PretrainConfig:
    return five_stage_config(tmp_path, "fsdp", lr=1e-2, bulk_mtp="joint", compile=False)


def _torchrun(cfg_file: Path, out: Path, *extra: str, fails: bool = False) -> list[dict]:
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "PYTHONFAULTHANDLER": "1"}  # a rank that aborts prints its Python stack
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(ROOT / "tests/pretrain/fsdp_job.py"), str(cfg_file), str(out), *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert (proc.returncode != 0) == fails, proc.stderr[-4000:]
    return [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]


def _run(cfg: PretrainConfig, tmp_path: Path, name: str, *extra: str,
         fails: bool = False) -> list[dict]:
    cfg_file = tmp_path / f"{name}.json"
    cfg_file.write_text(cfg.model_dump_json())
    return _torchrun(cfg_file, tmp_path / name, *extra, fails=fails)


def test_two_processes_train_every_stage_with_fsdp(tmp_path):
    cfg = _config(tmp_path)
    selfgen = cfg.stages[4]  # 5 prompts: shares of 3 and 2 (+1 padding)
    selfgen = selfgen.model_copy(update={"self_gen": selfgen.self_gen.model_copy(
        update={"prompts": 5})})
    cfg = cfg.model_copy(update={"stages": [*cfg.stages[:4], selfgen]})
    r0, r1 = _run(cfg, tmp_path, "first")
    assert r0["world"] == r1["world"] == 2 and r0["sharded"] == r1["sharded"] == "DTensor"
    # Every rank evaluates the same model: the same losses, stage by stage.
    assert r0["report"] == r1["report"]
    # Every parameter trained: the root's too (embedding, final norm), gathered by the base
    # eval before the optimizer was built.
    assert r0["untrained"] == []
    # Each stage shares its rows out: the ranks' first epochs are disjoint.
    assert r0["orders"].keys() == r1["orders"].keys() and len(r0["orders"]) == 5
    assert all(not set(r0["orders"][s]) & set(r1["orders"][s]) for s in r0["orders"])
    loss = r0["report"]["eval_loss"]
    assert set(loss) == {"base", "bulk", "mtp", "long", "sft", "mtp_self"}
    assert loss["bulk"] < loss["base"] and loss["mtp"] == loss["bulk"]  # distilling: frozen
    assert set(r0["report"]["probe"]) == {"long/before", "long/after"}
    # The MTP modules, whole on each rank and trained on each rank's own batches, stay alike.
    assert r0["mtp"] == r1["mtp"]
    run_dir = tmp_path / "runs" / "fsdp"
    # Rank 0 alone wrote: one metrics line per step, one report, one set of self shards.
    metrics = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == sum(s.steps for s in cfg.stages)
    assert json.loads((run_dir / "report.json").read_text())["eval_loss"] == loss
    # The ranks continued their own shares of the prompts; rank 0 wrote them all, in order.
    (own,) = (run_dir / "data" / "self").glob("mtp_self-*")
    g = selfgen.self_gen
    prompts = prompt_windows(TokenShards(run_dir / "data" / "train"), g.prompts, g.prompt_len,
                             cfg.seed + 31, g.doc_start_frac)
    written = TokenShards(own)
    assert len(written) == 5 and written.doc_lengths().tolist() == [16] * 5
    assert [written.doc(i)[:8].tolist() for i in range(5)] == prompts.tolist()
    # Each rank kept the hidden states of its own continuations (its padding row left out),
    # and rank 0 indexed them in the shards' order: those of the model that wrote them, which
    # the stage trained on (rows packed with origins) with the root gathered by hand.
    assert sorted({f.name[:8] for f in (own / "hidden").glob("*.f16")}) == [
        "part_000", "part_001"]
    feats = TokenFeatures(own / "hidden")
    assert len(feats) == 80
    model, _ = load_model(run_dir / "final")  # frozen in mtp_self: the model that wrote them
    with torch.no_grad():
        full = model.hidden(torch.from_numpy(np.stack([written.doc(i) for i in range(5)])))
    got = feats.gather(np.arange(80)).view(5, 16, -1)
    assert ((got - full).abs() <= full.abs().amax(-1, keepdim=True) * 2.0**-10).all()
    (packed,) = (run_dir / "data" / "packed").glob("mtp_self-*")
    assert (packed / "origin.npy").exists()
    # The final checkpoint holds the gathered weights: a single process loads them.
    model, mtp = build_model(cfg)
    load_weights(run_dir / "final", model, mtp)
    assert digest(model.state_dict()) == r0["model"] and digest(mtp.state_dict()) == r0["mtp"]
    assert (run_dir / "hf" / "model.safetensors").exists()
    # Run again: every stage loads its checkpoint into the sharded model and is skipped.
    a0, a1 = _run(cfg, tmp_path, "again")
    assert a0["report"]["eval_loss"] == a1["report"]["eval_loss"] == loss
    assert a0["model"] == r0["model"] and a0["mtp"] == a1["mtp"] == r0["mtp"]
    assert torch.isfinite(torch.tensor(list(loss.values()))).all()


def test_an_moe_models_expert_biases_move_alike_on_every_rank(tmp_path):
    """Each rank routes its own batches; the aux-loss-free bias update counts every rank's.
    The sharded blocks recompute their activations in backward (FSDP2 with activation
    checkpointing), routing as their forward did."""
    cfg = _config(tmp_path)
    moe = {"n_routed_experts": 4, "top_k": 2, "expert_ffn_dim": 16, "n_shared_experts": 1,
           "first_dense_layers": 1, "bias_update_speed": 0.01}
    model = cfg.model.model_copy(update={"activation_checkpointing": True, "tiny_overrides": {
        **cfg.model.tiny_overrides, "n_layers": 3, "moe": moe}})
    bulk = cfg.stages[0].model_copy(update={"steps": 3})  # an odd count of ±γ steps
    cfg = cfg.model_copy(update={"model": model, "stages": [bulk, cfg.stages[1]]})
    r0, r1 = _run(cfg, tmp_path, "moe")
    assert r0["report"] == r1["report"] and r0["mtp"] == r1["mtp"]
    assert r0["expert_bias"] == r1["expert_bias"]
    final, _ = build_model(cfg)
    load_weights(tmp_path / "runs" / "fsdp" / "final", final)
    biases = [b for n, b in final.named_buffers() if n.endswith("expert_bias")]
    assert biases and any(b.abs().sum() > 0 for b in biases)  # they did move


def test_a_preempted_sharded_run_resumes_exactly(tmp_path):
    """Interrupted right after a mid-stage checkpoint and run again, a two-process run logs the
    same losses and gradient norms, bit for bit, and ends with the same weights as a run never
    interrupted: the checkpoint holds the gathered optimizer moments (of the sharded model and
    of the MTP modules kept whole), and every rank gets its shards of them back. In bf16, as on
    GPUs: FSDP gathers bf16 weights, computes under autocast and reduces in fp32. Interrupted
    again in the distillation on stored hidden states, the resumed stage gathers the root
    before any forward of the model has run in its process."""
    cfg = _config(tmp_path)
    bulk = cfg.stages[0].model_copy(update={"steps": 4, "checkpoint_every": 2})
    own = cfg.stages[4].model_copy(update={"steps": 4, "checkpoint_every": 2})
    cfg = cfg.model_copy(update={"stages": [bulk, own],
                                 "model": cfg.model.model_copy(update={"dtype": "bf16"})})
    whole = cfg.model_copy(update={"out_dir": str(tmp_path / "whole")})
    (ref, _) = _run(whole, tmp_path, "ref")
    assert _run(cfg, tmp_path, "first", "interrupt") == []  # stopped: no rank reported
    metrics = cfg.run_dir / "metrics.jsonl"
    assert len(metrics.read_text().splitlines()) == 2
    preempted = shutil.copytree(cfg.run_dir / "ckpt" / "bulk", tmp_path / "preempted")
    assert _run(cfg, tmp_path, "second", "interrupt") == []  # bulk done, mtp_self at step 2
    assert len(metrics.read_text().splitlines()) == 6
    (again, _) = _run(cfg, tmp_path, "again")

    def logged(run_dir: Path) -> list[tuple]:
        lines = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        return [(m["stage"], m["step"], m["loss"], m["grad_norm"]) for m in lines]

    assert logged(cfg.run_dir) == logged(whole.run_dir)
    assert len(logged(cfg.run_dir)) == 8
    (packed,) = (cfg.run_dir / "data" / "packed").glob("mtp_self-*")
    assert (packed / "origin.npy").exists()  # it trained on the stored hidden states
    assert again["model"] == ref["model"] and again["mtp"] == ref["mtp"]
    assert again["report"]["eval_loss"] == ref["report"]["eval_loss"]
    assert again["gathered_dtype"] == "torch.bfloat16"  # the weights FSDP gathered
    # The checkpoint holds whole tensors: one process takes the optimizer state too.
    model, mtp = build_model(cfg)
    load_weights(preempted, model, mtp)
    params = [*model.parameters(), *mtp.parameters()]
    opt = build_adamw([("", p) for p in params], 1e-3, 0.0, (0.9, 0.95))
    load_trainer_state(preempted, model, mtp, opt)
    assert [opt.state[p]["exp_avg"].shape for p in params] == [p.shape for p in params]
    assert all(float(opt.state[p]["step"]) == 2 for p in params)
    # A finished stage is never resumed: its checkpoint holds no optimizer state.
    assert torch.load(cfg.run_dir / "ckpt" / "bulk" / "trainer.pt",
                      weights_only=False)["optimizer"] is None


def test_a_job_killed_in_its_generation_goes_on_from_where_every_rank_was(tmp_path):
    """A two-process job killed while its ranks continue their shares of the prompts, one of
    them a stretch further than the other, goes on from the last stretch both finished, and
    writes the continuations and hidden states, and trains the modules, as a job never
    killed."""
    cfg = _config(tmp_path)
    own = cfg.stages[4]  # 9 prompts: shares of 5 and 4 (+1 padding), batches of 2, 2 and 1
    own = own.model_copy(update={"self_gen": own.self_gen.model_copy(update={"prompts": 9})})
    cfg = cfg.model_copy(update={"stages": [own]})
    whole = cfg.model_copy(update={"out_dir": str(tmp_path / "whole")})
    (ref, _) = _run(whole, tmp_path, "ref", "stretches")
    assert ref["generated"] == [2, 2, 1]
    assert _run(cfg, tmp_path, "killed", "stretches", "kill", fails=True) == []
    (out,) = (cfg.run_dir / "data" / "self").glob("mtp_self-*")
    logged = [len(json.loads((out / "progress" / f"rank_{r:03d}.json").read_text())["stretches"])
              for r in (0, 1)]
    assert logged == [2, 1]
    (r0, r1) = _run(cfg, tmp_path, "again", "stretches")
    assert r0["generated"] == r1["generated"] == [2, 1]  # both from the first stretch's end
    (ref_out,) = (whole.run_dir / "data" / "self").glob("mtp_self-*")
    assert not (out / "progress").exists()

    def files(d: Path) -> dict[str, bytes]:
        return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*"))
                if p.is_file()}

    assert files(out) == files(ref_out)
    assert r0["mtp"] == r1["mtp"] == ref["mtp"] and r0["model"] == ref["model"]
    assert r0["report"]["eval_loss"] == ref["report"]["eval_loss"]
