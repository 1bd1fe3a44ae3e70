"""The job `test_distributed.py` launches under torchrun: the pretraining loop on a config (a
JSON file), then what each rank holds, written to ``<out>/rank<r>.json`` for the test to
compare. Further arguments: ``interrupt``, every rank stops right after the first mid-stage
checkpoint, as a preempted job would; ``stretches``, a generation of continuations is logged
after every batch (`write_self_shards`' resumable stretches); ``kill``, with it, rank 1 dies
(`os._exit`) as it logs its second stretch, once rank 0 has logged its own second: the ranks of
a job killed part-way have logged different numbers of stretches."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console

from codedojo.model.tokenizer import load_tokenizer
from codedojo.pretrain.checkpoint import full_state_dict
from codedojo.pretrain.config import PretrainConfig
from codedojo.pretrain.parallel import exit_distributed
from codedojo.pretrain.trainer import run


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(tensors[k].detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


class Interrupted(Exception):
    pass


def main() -> None:
    cfg = PretrainConfig.model_validate_json(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    captured: dict[str, object] = {}
    import codedojo.pretrain.trainer as trainer

    build = trainer.build_model

    def keep(cfg_):  # the modules the loop trains, to read back after it
        model, mtp = build(cfg_)
        if mtp is not None:  # as a base model's unseeded MTP init would: unlike on each rank
            with torch.no_grad():
                for p in mtp.parameters():
                    p.add_(0.01 * dist.get_rank())
        captured.update(model=model, mtp=mtp, init={n: p.detach().clone()
                                                    for n, p in model.named_parameters()})

        def seen(block, args, out):  # runs before FSDP frees the gathered weights
            captured["gathered_dtype"] = str(block.attn_norm.weight.dtype)

        model.layers[0].register_forward_hook(seen)
        return model, mtp

    trainer.build_model = keep
    orders: dict[int, list[int]] = {}  # the rows each stage's loader gave this rank first

    class Loader(trainer.PackedLoader):
        def _make_order(self):
            order = super()._make_order()
            orders.setdefault(self.seed, order.tolist())
            return order

    trainer.PackedLoader = Loader
    from codedojo.pretrain import selfgen

    generated = []  # this rank's batches of continuations
    continue_ = selfgen.greedy_continue
    selfgen.greedy_continue = lambda m, x, *a, **k: generated.append(len(x)) or continue_(
        m, x, *a, **k)
    modes = sys.argv[3:]
    if "stretches" in modes:  # the hidden states of one batch (2 rows of 16 tokens) a part
        part = 2 * 16 * cfg.model.tiny_overrides["dim"] * 2
        trainer.write_self_shards = functools.partial(selfgen.write_self_shards, part_bytes=part)
    if "kill" in modes:
        save = selfgen.ProgressLog.save

        def save_or_die(log, *args):
            if log.rank == 1 and len(log.stretches) == 1:
                theirs = log.dir / "rank_000.json"
                while len(json.loads(theirs.read_text())["stretches"]) < 2:
                    time.sleep(0.05)
                os._exit(1)
            save(log, *args)

        selfgen.ProgressLog.save = save_or_die
    if "interrupt" in modes:
        save = trainer.save_checkpoint

        def save_then_stop(*args, **kw):
            path = save(*args, **kw)
            if not args[5].done:  # the position: a checkpoint mid-stage
                raise Interrupted
            return path

        trainer.save_checkpoint = save_then_stop
    torch.set_num_threads(1)
    try:
        report = run(cfg, tok=load_tokenizer(), console=Console(quiet=True))
    except Interrupted:
        exit_distributed()
    model, mtp = captured["model"], captured["mtp"]
    full = full_state_dict(model)  # every rank takes part; rank 0 gets the weights
    rank = dist.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps({
        "world": dist.get_world_size(), "report": report, "orders": orders,
        "mtp": digest(mtp.state_dict()) if mtp is not None else None,
        "model": digest(full) if full else None,
        "untrained": sorted(n for n, w in full.items()  # rank 0: all of it
                            if n in captured["init"] and torch.equal(w, captured["init"][n])),
        "expert_bias": digest({n: b for n, b in model.named_buffers()  # this rank's own
                               if n.endswith("expert_bias")}),
        "sharded": type(next(model.parameters())).__name__, "generated": generated,
        "gathered_dtype": captured.get("gathered_dtype")}))  # None: no forward ran
    exit_distributed()


if __name__ == "__main__":
    main()
