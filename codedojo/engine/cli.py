"""`dojo serve`: the OpenAI-compatible server on one engine. Heavy imports happen inside the command."""

from __future__ import annotations

from pathlib import Path

import typer

DEFAULT_MODEL = "smollm2-135m-instruct"
DTYPES = ("float32", "bfloat16")


def serve(
    model: str = typer.Option(DEFAULT_MODEL, help="a known model name, a .gguf file, an HF "
                              "directory or a `dojo pretrain` checkpoint (runs/<name>/final)"),
    host: str = typer.Option("127.0.0.1", help="address to listen on"),
    port: int = typer.Option(8000, help="port (0 picks a free one)"),
    max_batch: int = typer.Option(16, help="requests decoded together (continuous batching)"),
    served_name: str = typer.Option("", help="model name clients use (default: --model)"),
    tool_format: str = typer.Option("smollm2", help="tool-call format: smollm2, hermes or qwen3_coder"),
    device: str = typer.Option("auto", help="where the model runs: auto (the first GPU when "
                               "CUDA is available, else the CPU), cpu, cuda or cuda:N"),
    dtype: str = typer.Option("float32", help="weights and KV cache: float32 or bfloat16 (half "
                              "the bytes read per token: on a CPU, where decoding is bound by "
                              "memory reads, about 1.8x the tokens/s; sums stay float32)"),
    speculative: bool = typer.Option(True, help="decode with the checkpoint's MTP modules as "
                                     "drafts when it has them"),
    draft_dtype: str = typer.Option("", help="the MTP drafts' type, float32 or bfloat16 "
                                    "(default: --dtype). Drafts only propose, so it changes how "
                                    "often they pass, not the output; bfloat16 drafts for a "
                                    "float32 model read half the bytes (on a 2-core CPU 1-3% "
                                    "more tokens/s, the same acceptance)"),
    spec_draft_cost: float | None = typer.Option(
        None, help="what one more draft per round costs, in plain decode steps (default: "
        "measured over the first 64 rounds; about 0.2 on a 2-core CPU): after 64 rounds, each "
        "round drafts the number of tokens that pays best by the acceptance seen (the "
        "engine's latest rounds and the request's own), and speculation pauses when none "
        "does (0: always every module)"),
    spec_explore_every: int = typer.Option(
        32, help="every N-th speculative round drafts with every module, so drafts that do not "
        "pay now are tested again, and paused speculation resumes when they come to pay (0: "
        "never, and speculation stops for good when no draft pays)"),
    spec_tree: int | None = typer.Option(
        None, help="greedy rounds may draft a tree of this many nodes (the likeliest drafts "
        "after each node, all verified in one pass) instead of a chain: probed against chains "
        "over the first 64 rounds and kept if it pays (0: chains; default: 5 on a GPU, chains "
        "on a CPU). On SmolLM2-135M's held-out code 5 nodes raised the tokens per pass from "
        "2.08 to 2.37 (7: 2.46), but on a 2-core CPU the wider pass cost a round 1.09 times as "
        "much (7: 1.19); on a GPU at batch 1 it costs little"),
    prefix_cache_tokens: int = typer.Option(
        16384, help="finished conversations' keys and values kept, in tokens, so a request "
        "that starts with one (the next turn of an agent loop) or with a running request's "
        "prompt (a group of samples) is prefilled only from where they part (0: off)"),
    record_routing: bool = typer.Option(
        False, help="an MoE model's requests record every token's experts, which clients get "
        "with return_routed_experts (RL rollouts, for router replay)"),
) -> None:
    """Serve /v1/chat/completions, /v1/completions and /v1/models for MODEL.

    A checkpoint directory with MTP modules (``mtp.safetensors``, as ``dojo pretrain`` writes
    beside the weights) decodes speculatively with them."""
    import signal
    import threading

    import torch
    from safetensors import SafetensorError

    from codedojo.devices import resolve_device
    from codedojo.engine.engine import Engine
    from codedojo.engine.server import BackgroundServer, create_app
    from codedojo.model.chat import ChatTemplate
    from codedojo.model.tokenizer import load_tokenizer
    from codedojo.model.weights import load_model

    if max_batch < 1:
        raise typer.BadParameter("must be >= 1", param_hint="--max-batch")
    if spec_draft_cost is not None and spec_draft_cost < 0:
        raise typer.BadParameter("must be >= 0", param_hint="--spec-draft-cost")
    if spec_explore_every < 0:
        raise typer.BadParameter("must be >= 0", param_hint="--spec-explore-every")
    if spec_tree is not None and spec_tree < 0:
        raise typer.BadParameter("must be >= 0", param_hint="--spec-tree")
    if prefix_cache_tokens < 0:
        raise typer.BadParameter("must be >= 0", param_hint="--prefix-cache-tokens")
    if not 0 <= port < 65536:
        raise typer.BadParameter("must be in [0, 65535]", param_hint="--port")
    if dtype not in DTYPES:
        raise typer.BadParameter(f"{dtype!r}: not one of {', '.join(DTYPES)}", param_hint="--dtype")
    if draft_dtype not in ("", *DTYPES):
        raise typer.BadParameter(f"{draft_dtype!r}: not one of {', '.join(DTYPES)}",
                                 param_hint="--draft-dtype")
    try:
        dev = resolve_device(device)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--device") from None
    try:
        tokenizer = load_tokenizer(model)
    except (FileNotFoundError, ValueError) as e:
        raise typer.BadParameter(str(e), param_hint="--model") from None
    try:
        chat = ChatTemplate(tokenizer, tool_format=tool_format)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--tool-format") from None
    try:
        net, _ = load_model(model, dtype=getattr(torch, dtype))
    except (OSError, ValueError) as e:  # a tokenizer without weights, a file that is not one
        raise typer.BadParameter(str(e), param_hint="--model") from None
    except SafetensorError as e:  # a weights file cut short (its own text names no file)
        raise typer.BadParameter(f"{model}: its .safetensors weights do not load: {e}",
                                 param_hint="--model") from None
    net = net.to(dev)
    drafter = None
    if speculative and Path(model).is_dir():
        from codedojo.engine.speculative import load_drafter

        draft_dtype = draft_dtype or dtype
        try:
            drafter = load_drafter(net, model, dtype=getattr(torch, draft_dtype))
        except torch.OutOfMemoryError:  # (the device's, not the files')
            raise
        except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as e:
            # mtp.json missing or not as written, mtp.safetensors cut short or of another shape
            raise typer.BadParameter(
                f"{model}: its MTP modules (mtp.json, mtp.safetensors) do not load: "
                f"{type(e).__name__}: {e} (--no-speculative serves without them)",
                param_hint="--model") from None
        if drafter is not None:
            print(f"Speculative decoding with {drafter.depth} MTP modules ({draft_dtype} drafts)",
                  flush=True)
    engine = Engine(net, max_batch=max_batch, drafter=drafter,
                    spec_draft_cost=spec_draft_cost, spec_explore_every=spec_explore_every,
                    spec_tree=spec_tree,
                    prefix_cache_tokens=prefix_cache_tokens, record_routing=record_routing)
    engine.start()
    name = served_name or model
    app = create_app(engine, tokenizer, chat, model_name=name)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    srv = BackgroundServer(app, host=host, port=port,
                           on_ready=lambda url: print(f"Serving {name} at {url}/v1", flush=True))
    try:
        srv.start(timeout=60)
        # The server runs on its own thread; the main thread waits for Ctrl-C or the server to exit.
        while not stop.wait(0.5) and srv.thread is not None and srv.thread.is_alive():
            pass
    except KeyboardInterrupt:
        pass
    except RuntimeError as e:  # from `start`: it could not listen there (a port taken)
        raise typer.BadParameter(str(e), param_hint="--host/--port") from None
    finally:
        srv.stop()
        engine.stop()


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
