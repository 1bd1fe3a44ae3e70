"""Where a pretraining run computes: the config's `model.device`, the machine's GPUs, and
torchrun's LOCAL_RANK."""

from __future__ import annotations

import pytest
import torch

from codedojo.pretrain.parallel import train_device
from codedojo.pretrain.trainer import on_device


def test_the_training_device_follows_the_config_and_the_machine(monkeypatch, gpus):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    gpus(0)
    assert train_device("auto") == torch.device("cpu")
    assert train_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="model.device = 'cuda'.*no CUDA device"):
        train_device("cuda")
    with pytest.raises(ValueError, match="model.device: 'gpu'"):
        train_device("gpu")
    monkeypatch.setenv("LOCAL_RANK", "1")  # (no GPU at all: more of them is no answer)
    with pytest.raises(ValueError, match="no CUDA device") as e:
        train_device("cuda")
    assert "LOCAL_RANK" not in str(e.value)
    monkeypatch.delenv("LOCAL_RANK")

    gpus(2)
    assert train_device("auto") == torch.device("cuda", 0)
    assert train_device("cpu") == torch.device("cpu")  # a CPU run on a GPU machine
    monkeypatch.setenv("LOCAL_RANK", "1")  # torchrun's second process on this node
    assert train_device("auto") == torch.device("cuda", 1)
    assert train_device("cuda") == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ValueError, match="'auto': this machine has 2 CUDA devices, so no GPU 2 "
                                         "for LOCAL_RANK 2"):
        train_device("auto")


def test_batches_follow_the_model():
    batch = {"tokens": torch.ones(2, 4, dtype=torch.long), "loss_mask": torch.ones(2, 4).bool()}
    moved = on_device(batch, torch.device("meta"))
    assert set(moved) == set(batch)
    assert all(v.device.type == "meta" and v.dtype == batch[k].dtype for k, v in moved.items())


# A dense model eagerly; its blocks compiled (Triton kernels); its blocks recomputed in backward
# (the CUDA RNG state replayed); an MoE model (routing, the grouped expert FFNs and the
# selection-bias update on the GPU).
GPU_RUNS = {"eager": {}, "compiled": {"compile": True},
            "checkpointed": {"activation_checkpointing": True},
            "moe": {"moe": {"n_routed_experts": 4, "top_k": 2, "expert_ffn_dim": 16,
                            "n_shared_experts": 1, "first_dense_layers": 1,
                            "bias_update_speed": 0.01}}}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variant", list(GPU_RUNS))
def test_a_whole_run_trains_on_the_gpu(tmp_path, variant):
    """All five stages on one GPU in bf16: each stage's batches, the teacher, the MTP modules,
    self-generation and the probe run there, and the checkpoint loads on the CPU."""
    from rich.console import Console

    from codedojo.model.tokenizer import load_tokenizer
    from codedojo.pretrain.checkpoint import load_weights
    from codedojo.pretrain.trainer import build_model, run
    from tests.pretrain.tiny_run import five_stage_config

    cfg = five_stage_config(tmp_path, "gpu", lr=1e-2, device="cuda", dtype="bf16")
    extra = dict(GPU_RUNS[variant])
    if "moe" in extra:
        over = {**cfg.model.tiny_overrides, "n_layers": 3, "moe": extra.pop("moe")}
        extra["tiny_overrides"] = over
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update=extra)})
    torch.cuda.reset_peak_memory_stats()
    report = run(cfg, tok=load_tokenizer(), console=Console(quiet=True))
    assert torch.cuda.max_memory_allocated() > 0
    assert report["eval_loss"]["bulk"] < report["eval_loss"]["base"]
    assert report["eval_loss"]["mtp"] == report["eval_loss"]["bulk"]  # frozen model
    model, mtp = build_model(cfg)
    load_weights(tmp_path / "runs" / "gpu" / "final", model, mtp)
    assert next(model.parameters()).device.type == "cpu"
