"""Training-step throughput: our decoder vs Hugging Face transformers, same model, batch, length.

Both load SmolLM2-135M-Instruct (ours through `load_model`, HF's `LlamaForCausalLM` from the same
converted safetensors directory), then time full steps (forward, loss, backward, AdamW step) on
the same random token batch, in this process, float32 on both sides. Ours is the step `dojo
pretrain` runs (`stage_loss`: the loss fused with the output projection, `build_adamw`); HF's is
what its Trainer does by default (`labels=` loss, fused AdamW). Prints one JSON line.

    python benchmarks/train_throughput.py [--batch 4] [--seq 256] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch


def _time_steps(step, n: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        step()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import transformers

    from codedojo.data.packing import make_batch
    from codedojo.model.weights import DEFAULT_MODEL, converted_dir, load_model
    from codedojo.pretrain.optim import build_adamw
    from codedojo.pretrain.trainer import stage_loss

    ours, cfg = load_model(DEFAULT_MODEL)
    ours.train()
    hf = transformers.LlamaForCausalLM.from_pretrained(converted_dir(DEFAULT_MODEL),
                                                       torch_dtype=torch.float32,
                                                       attn_implementation="sdpa")
    hf.train()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
    x = tokens[:, :-1]
    batch = make_batch(tokens.numpy(), np.zeros(tokens.shape, np.int32),
                       np.ones(tokens.shape, bool))
    opt_o = build_adamw(list(ours.named_parameters()), 1e-5, 0.0, (0.9, 0.999))
    opt_h = torch.optim.AdamW(hf.parameters(), lr=1e-5, fused=True)

    def step_ours() -> None:
        loss, _ = stage_loss(ours, None, batch, "off", 0.0)
        loss.backward()
        opt_o.step()
        opt_o.zero_grad(set_to_none=True)

    def step_hf() -> None:
        out = hf(input_ids=x, labels=tokens[:, :-1])  # HF shifts labels internally
        out.loss.backward()
        opt_h.step()
        opt_h.zero_grad(set_to_none=True)

    # Interleave to share whatever load the machine has evenly between the two.
    t_o = t_h = 0.0
    for _ in range(args.steps):
        t_o += _time_steps(step_ours, 1, warmup=0 if t_o else 1)
        t_h += _time_steps(step_hf, 1, warmup=0 if t_h else 1)
    ntok = args.batch * args.seq * args.steps
    print(json.dumps({"ours_tok_s": round(ntok / t_o, 1), "hf_tok_s": round(ntok / t_h, 1),
                      "ratio": round(t_h / t_o, 3), "batch": args.batch, "seq": args.seq,
                      "steps": args.steps, "threads": args.threads,
                      "transformers": transformers.__version__}))


if __name__ == "__main__":
    main()
