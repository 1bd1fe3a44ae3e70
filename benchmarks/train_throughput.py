"""Training-step throughput: our decoder vs Hugging Face transformers, same model, batch, length.

Both load SmolLM2-135M-Instruct (ours through `load_model`, HF's `LlamaForCausalLM` from the same
converted safetensors directory), then time full steps (forward, loss, backward, AdamW step) on
the same random token batch, in this process, float32 on both sides. Ours is the step `dojo
pretrain` runs with `configs/cpt-smollm2.toml` (`stage_loss`: the loss fused with the output
projection, `build_adamw`, blocks compiled by `apply_compile`); HF's is what its Trainer does by
default (`labels=` loss, fused AdamW, no compile). Our eager step (`compile = false`) is timed in
the same run (`ours_eager_tok_s`, `eager_ratio`). The steps of the three alternate, so a change
in the machine's load falls on all of them. Prints one JSON line.

On a GPU (`--device cuda --bf16`), both sides run forward and backward under bf16 autocast with
fp32 master weights, as `dtype = "bf16"` trains. `--random-init` builds the same shapes with
random weights (HF's copied from ours), for a machine without the GGUF: the time of a step does
not depend on the values of the weights.

    python benchmarks/train_throughput.py [--batch 4] [--seq 256] [--steps 4] [--no-compile]
        [--device cuda] [--bf16] [--random-init]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import time
from collections.abc import Callable

import numpy as np
import torch


def _seconds(step: Callable[[], None], device: torch.device) -> float:
    t0 = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # kernels are queued: count them all
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-compile", action="store_true", help="time our eager step only")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--bf16", action="store_true", help="forward/backward under bf16 autocast")
    ap.add_argument("--random-init", action="store_true",
                    help="SmolLM2-135M's shapes with random weights (no GGUF needed)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    import transformers

    from codedojo.data.packing import make_batch
    from codedojo.model.config import ModelConfig
    from codedojo.model.hf import hf_config, state_dict_to_hf
    from codedojo.model.transformer import Transformer
    from codedojo.model.weights import DEFAULT_MODEL, converted_dir, load_model
    from codedojo.pretrain.optim import build_adamw
    from codedojo.pretrain.parallel import apply_compile
    from codedojo.pretrain.trainer import on_device, stage_loss

    if args.random_init:
        cfg = ModelConfig.smollm2_135m()
        torch.manual_seed(0)
        ours = Transformer(cfg)
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **hf_config(cfg), attn_implementation="sdpa"))
        keys = hf.load_state_dict(state_dict_to_hf(ours.state_dict(), cfg), strict=False)
        assert set(keys.missing_keys) <= {"lm_head.weight"} and not keys.unexpected_keys, keys
    else:
        ours, cfg = load_model(DEFAULT_MODEL)
        hf = transformers.LlamaForCausalLM.from_pretrained(converted_dir(DEFAULT_MODEL),
                                                           torch_dtype=torch.float32,
                                                           attn_implementation="sdpa")
    ours.to(device).train()
    hf.to(device).train()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
    batch = on_device(make_batch(tokens.numpy(), np.zeros(tokens.shape, np.int32),
                                 np.ones(tokens.shape, bool)), device)
    tokens = tokens.to(device)
    x = tokens[:, :-1]

    def autocast() -> contextlib.AbstractContextManager:
        return (torch.autocast(device.type, dtype=torch.bfloat16) if args.bf16
                else contextlib.nullcontext())

    def ours_step(model: torch.nn.Module) -> Callable[[], None]:
        opt = build_adamw(list(model.named_parameters()), 1e-5, 0.0, (0.9, 0.999))

        def step() -> None:
            with autocast():
                loss, _ = stage_loss(model, None, batch, "off", 0.0)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    opt_h = torch.optim.AdamW(hf.parameters(), lr=1e-5, fused=True)

    def step_hf() -> None:
        with autocast():
            out = hf(input_ids=x, labels=tokens[:, :-1])  # HF shifts labels internally
        out.loss.backward()
        opt_h.step()
        opt_h.zero_grad(set_to_none=True)

    steps = {"ours_eager": ours_step(ours), "hf": step_hf}
    if not args.no_compile:
        compiled = copy.deepcopy(ours)
        apply_compile(compiled)
        steps["ours"] = ours_step(compiled)
    elapsed = dict.fromkeys(steps, 0.0)
    for step in steps.values():  # warm up (and compile) outside the timing
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the warm-up's queued kernels, before the first timing
    for _ in range(args.steps):  # interleaved: load changes fall on every side alike
        for name, step in steps.items():
            elapsed[name] += _seconds(step, device)
    ntok = args.batch * args.seq * args.steps
    if args.no_compile:
        elapsed["ours"] = elapsed["ours_eager"]
    print(json.dumps({"bench": "train_throughput",
                      "ours_tok_s": round(ntok / elapsed["ours"], 1),
                      "hf_tok_s": round(ntok / elapsed["hf"], 1),
                      "ratio": round(elapsed["hf"] / elapsed["ours"], 3),
                      "ours_eager_tok_s": round(ntok / elapsed["ours_eager"], 1),
                      "eager_ratio": round(elapsed["hf"] / elapsed["ours_eager"], 3),
                      "compiled": not args.no_compile, "batch": args.batch, "seq": args.seq,
                      "steps": args.steps, "threads": args.threads, "device": str(device),
                      "bf16": args.bf16, "random_init": args.random_init,
                      "transformers": transformers.__version__}))

if __name__ == "__main__":
    main()
