"""The engine away from the CPU: `dojo serve --device`, and on a GPU the same tokens as on the
CPU (batched prefill and decode, seeded sampling, prefix reuse, weight pushes, speculative
decoding with a checkpoint's MTP modules, recorded MoE routing)."""

from __future__ import annotations

import copy

import pytest
import torch

from codedojo.devices import resolve_device
from codedojo.engine.engine import Engine
from codedojo.engine.speculative import load_drafter
from codedojo.engine.types import SamplingParams
from codedojo.model.config import ModelConfig
from codedojo.model.mtp import MTP, save_mtp
from codedojo.model.transformer import Transformer
from tests.engine.tiny_moe import MOE_LAYERS, TOP_K, tiny_moe

PROMPTS = [[5, 9, 2, 31, 7], [1, 2, 3], [40, 41, 42, 43, 44, 45, 46, 47], [11]]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_the_serving_device_follows_the_request_and_the_machine(gpus):
    gpus(0)
    assert resolve_device("auto") == resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="'cuda': this machine has no CUDA devices"):
        resolve_device("cuda")
    for bad in ("tpu", "cuda:x", "meta", "cpu:1"):
        with pytest.raises(ValueError, match=f"'{bad}': not one of auto, cpu, cuda, cuda:N"):
            resolve_device(bad)
    gpus(2)
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")  # a CPU server on a GPU machine
    with pytest.raises(ValueError, match="'cuda:2': this machine has 2 CUDA devices, so no GPU 2"):
        resolve_device("cuda:2")


def test_dojo_serve_names_a_bad_device():
    from typer.testing import CliRunner

    from codedojo.cli import app

    r = CliRunner().invoke(app, ["serve", "--device", "tpu"])
    assert r.exit_code == 2 and "--device" in r.output and "tpu" in r.output


def _tiny() -> Transformer:
    torch.manual_seed(0)
    m = Transformer(ModelConfig.tiny(vocab_size=64, max_seq_len=128)).eval()
    with torch.no_grad():
        m.tok_embeddings.weight.mul_(20)  # peaked next-token distributions: no near-ties
    return m


def _both(model: Transformer, prompts: list[list[int]], params, **engine_kw
          ) -> tuple[list, list]:
    """The same requests on a CPU engine and a CUDA one over a copy of the model."""
    cpu = Engine(model, **engine_kw).generate(prompts, params)
    gpu = Engine(copy.deepcopy(model).cuda(), **engine_kw).generate(prompts, params)
    return cpu, gpu


@needs_cuda
def test_batched_and_seeded_decoding_on_the_gpu_give_the_cpus_tokens():
    greedy = SamplingParams(max_tokens=12, temperature=0, logprobs=True)
    cpu, gpu = _both(_tiny(), PROMPTS, greedy, max_batch=3)  # requests queue
    for c, g in zip(cpu, gpu, strict=True):
        assert g.token_ids == c.token_ids
        assert g.logprobs == pytest.approx(c.logprobs, abs=1e-4)
    # sampled on the CPU from the GPU's logits, with each request's own generator
    sampled = [SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=i, logprobs=True,
                              top_logprobs=2) for i in range(len(PROMPTS))]
    cpu, gpu = _both(_tiny(), PROMPTS, sampled, max_batch=4)
    for c, g in zip(cpu, gpu, strict=True):
        assert g.token_ids == c.token_ids
        assert g.logprobs == pytest.approx(c.logprobs, abs=1e-4)


@needs_cuda
def test_prefix_reuse_and_weight_pushes_on_the_gpu():
    model = _tiny().cuda()
    engine = Engine(model, max_batch=2)
    greedy = SamplingParams(max_tokens=8, temperature=0)
    convo = PROMPTS[2] * 5  # 40 tokens: long enough to be kept (engine.PREFIX_MIN_TOKENS)
    first = engine.generate([convo], greedy)[0]
    turn = convo + first.token_ids + [3, 4]
    second = engine.generate([turn], greedy)[0]
    assert second.cached_tokens >= len(convo)  # keys and values kept on the GPU
    alone = Engine(copy.deepcopy(model), max_batch=2).generate([turn], greedy)[0]
    assert second.token_ids == alone.token_ids
    pushed = {k: v.cpu() * 0.5 for k, v in model.state_dict().items() if k.endswith("weight")}
    engine.load_weights(pushed, version=3)  # from the trainer's CPU copy
    after = engine.generate([PROMPTS[0]], greedy)[0]
    assert after.weight_version == 3
    own = model.state_dict()
    assert all(torch.equal(own[k].cpu(), v) for k, v in pushed.items())


@needs_cuda
@pytest.mark.parametrize(("draft_vocab", "tree", "taps", "blocks"),
                         [(0, 0, (), 1), (32, 0, (), 1), (32, None, (), 1), (0, 0, (0,), 1),
                          (32, None, (0,), 1), (32, None, (0,), 2)])
def test_speculative_decoding_on_the_gpu(tmp_path, draft_vocab, tree, taps, blocks):
    """A checkpoint's MTP modules load beside the model on the GPU; greedy output equals plain
    decoding (with draft trees too, a GPU engine's default: their masks built on the GPU; with
    modules that read a lower layer's states, op by op there; and with modules of two blocks,
    a cache layer each), and a sampled request draws its drafts and corrections on the CPU."""
    model = _tiny()
    mtp = MTP(model.cfg, 2, draft_vocab, taps, blocks)
    mtp.init_from_model(model)
    with torch.no_grad():
        for layer in mtp.layers:
            if layer.fuse is not None:  # away from zero, so the drafts depend on the taps
                layer.fuse.weight.normal_(std=0.02)
            for block in layer.extra_blocks:  # away from the identity, so that they count
                block.attn.wo.weight.normal_(std=0.02)
                block.mlp.w_down.weight.normal_(std=0.02)
    if draft_vocab:
        mtp.set_draft_vocab(torch.arange(model.cfg.vocab_size).flip(0))
    save_mtp(mtp, tmp_path)
    gpu = copy.deepcopy(model).cuda()
    drafter = load_drafter(gpu, tmp_path)
    assert drafter is not None and next(drafter.mtp.parameters()).is_cuda
    assert drafter.taps == taps
    greedy = SamplingParams(max_tokens=24, temperature=0, logprobs=True)
    plain = Engine(gpu, max_batch=2).generate([PROMPTS[0]], greedy)[0]
    engine = Engine(gpu, max_batch=2, drafter=drafter, spec_draft_cost=0, spec_tree=tree)
    assert (engine.spec_tree is None) == (tree == 0)
    spec = engine.generate([PROMPTS[0]], greedy)[0]
    assert spec.token_ids == plain.token_ids
    assert spec.logprobs == pytest.approx(plain.logprobs, abs=1e-4)
    assert engine.spec_stats.rounds > 0
    sampled = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=24, temperature=0.8,
                                                           seed=1))[0]
    assert len(sampled.token_ids) == 24 and all(0 <= t < 64 for t in sampled.token_ids)


@needs_cuda
def test_recorded_moe_routing_on_the_gpu_is_the_cpus():
    params = SamplingParams(max_tokens=6, temperature=0)
    cpu, gpu = _both(tiny_moe(), PROMPTS[:3], params, max_batch=2, record_routing=True)
    for c, g in zip(cpu, gpu, strict=True):
        assert g.token_ids == c.token_ids
        n = len(g.prompt_ids) + len(g.token_ids) - 1
        assert g.routed_experts is not None and g.routed_experts.device.type == "cpu"
        assert g.routed_experts.shape == (n, MOE_LAYERS, TOP_K)
        assert torch.equal(g.routed_experts, c.routed_experts)
