"""Training-step throughput: our decoder vs Hugging Face transformers, same model, batch, length.

Both load SmolLM2-135M-Instruct (ours through `load_model`, HF's `LlamaForCausalLM` from the same
converted safetensors directory), then time full steps (forward, loss, backward, AdamW step) on
the same random token batch, in this process. Prints one JSON line.

    python benchmarks/train_throughput.py [--batch 4] [--seq 256] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F


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

    from codedojo.model.weights import DEFAULT_MODEL, converted_dir, load_model

    ours, cfg = load_model(DEFAULT_MODEL)
    ours.train()
    hf = transformers.LlamaForCausalLM.from_pretrained(converted_dir(DEFAULT_MODEL),
                                                       torch_dtype=torch.float32,
                                                       attn_implementation="sdpa")
    hf.train()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    opt_o = torch.optim.AdamW(ours.parameters(), lr=1e-5)
    opt_h = torch.optim.AdamW(hf.parameters(), lr=1e-5)

    def step_ours() -> None:
        logits = ours(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
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
