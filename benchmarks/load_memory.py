"""Peak memory of loading a model for serving (`codedojo.model.weights.build_model`) against the
earlier way of building it, on the same weights in the same run: each way in a fresh process,
whose peak resident size (``ru_maxrss``) is read after the build, less that of the process
with the weights read (and touched, all of them resident) and nothing built. Every process,
that one too, first builds the model on the meta device (no memory for its tensors), which pays
the one-off imports a first build makes (tens of MB of modules) before the build measured.

- ``build``: the model made on the meta device, the state dict's tensors assigned to it, then
  each weight copied once into its huge-page place, converted to the dtype.
- ``baseline``: the earlier build: the model allocated in float32 (`to_empty`), the state dict
  copied in, converted with `.to(dtype)`, then moved into huge pages.

Prints one JSON line per dtype: ``weights_read_mb``, the peak MB of the process with the weights
read (the interpreter and the imports included); ``extra_mb_*``, each way's peak MB above it;
``model_mb``, the parameters' MB as built; ``no_imports_measured`` (checked), that neither build
imported a module (its one-off imports were paid before, as in the process it is set against).

    python benchmarks/load_memory.py [--model smollm2-135m-instruct | FILE.gguf | DIR]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def baseline_build(sd: dict[str, torch.Tensor], cfg: object, dtype: torch.dtype) -> object:
    from codedojo.model.transformer import Transformer
    from codedojo.ops import move_to_huge_pages

    with torch.device("meta"):
        model = Transformer(cfg)  # type: ignore[arg-type]
    model = model.to_empty(device="cpu")
    model.rotary = type(model.rotary)(cfg)
    model.load_state_dict(sd, strict=True)
    model = model.to(dtype).eval()
    move_to_huge_pages(model)
    return model


def child(model: str, way: str, dtype: str) -> None:
    """Runs in its own process: read the weights, build one way, print the peak MB (and the
    modules the build imported)."""
    from codedojo.model.transformer import Transformer
    from codedojo.model.weights import build_model, read_weights

    try:
        sd, cfg = read_weights(model)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(str(e))
    for t in sd.values():  # make them resident (safetensors may map the file)
        t.sum()
    with torch.device("meta"):  # the one-off imports of a first build, in every child
        Transformer(cfg)  # type: ignore[arg-type]
    modules = len(sys.modules)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if way == "build":
        m = build_model(sd, cfg, DTYPES[dtype])
    elif way == "baseline":
        m = baseline_build(sd, cfg, DTYPES[dtype])
    else:
        m = None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    params = 0 if m is None else sum(p.numel() * p.element_size() for p in m.parameters())
    print(json.dumps({"read_mb": before, "peak_mb": peak, "param_mb": params / 2**20,
                      "imported": len(sys.modules) - modules}))


def measure(model: str, way: str, dtype: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--child", way, "--dtype", dtype,
                          "--model", model], capture_output=True, text=True)
    if out.returncode:
        sys.exit(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="a known name, a .gguf file, an HF directory or a training checkpoint")
    ap.add_argument("--child", choices=["build", "baseline", "read"])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = ap.parse_args()
    if args.child:
        child(args.model, args.child, args.dtype)
        return
    for dtype in DTYPES:
        read = measure(args.model, "read", dtype)
        new = measure(args.model, "build", dtype)
        old = measure(args.model, "baseline", dtype)
        print(json.dumps({
            "bench": "load_memory", "model": args.model, "dtype": dtype,
            "weights_read_mb": round(read["peak_mb"]), "model_mb": round(new["param_mb"]),
            "extra_mb_build": round(new["peak_mb"] - read["peak_mb"]),
            "extra_mb_baseline": round(old["peak_mb"] - read["peak_mb"]),
            "no_imports_measured": new["imported"] == old["imported"] == 0,
        }))


if __name__ == "__main__":
    main()
