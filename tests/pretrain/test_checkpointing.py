"""Activation checkpointing: recomputed blocks give the gradients stored ones give, the model
keeps its names and its decode path, and an MoE block recomputes the routing of its forward. A
copy of a wrapped model computes with its own weights."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from codedojo.model.config import ModelConfig, MoEConfig
from codedojo.model.moe import (
    counting_tokens,
    moe_aux_loss,
    moe_layers,
    recorded_routing,
    router_replay,
)
from codedojo.model.transformer import Transformer
from codedojo.pretrain.parallel import apply_activation_checkpointing, apply_compile
from codedojo.pretrain.selfgen import greedy_continue

MOE = MoEConfig(n_routed_experts=8, top_k=2, expert_ffn_dim=16, n_shared_experts=1,
                first_dense_layers=1, seq_aux_loss_coef=0.01)


def _pair(cfg: ModelConfig) -> tuple[Transformer, Transformer]:
    """A model in training mode, and a copy of it whose blocks recompute in backward."""
    torch.manual_seed(0)
    plain = Transformer(cfg).train()
    recomputed = copy.deepcopy(plain)
    apply_activation_checkpointing(recomputed)
    return plain, recomputed


def _grads(model: Transformer, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    aux = moe_aux_loss(model)
    (loss if aux is None else loss + aux).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=1e-6, msg=n)


def test_recomputed_blocks_train_alike_and_keep_names_and_decoding():
    plain, recomputed = _pair(ModelConfig.tiny())
    tokens = torch.randint(0, 256, (2, 12))
    _assert_same(_grads(plain, tokens), _grads(recomputed, tokens))
    assert list(recomputed.state_dict()) == list(plain.state_dict())
    # decoding (a KV cache, no gradients) runs the blocks as they are, fused kernels included
    prompts = torch.randint(0, 256, (2, 5))
    assert torch.equal(greedy_continue(recomputed, prompts, 6), greedy_continue(plain, prompts, 6))
    assert recomputed.training  # greedy_continue put the training mode back
    apply_activation_checkpointing(recomputed)  # a second call leaves the blocks as they are
    _assert_same(_grads(plain, tokens), _grads(recomputed, tokens))


def test_a_copy_of_a_wrapped_model_runs_its_own_weights():
    """A reference policy or an EMA is often a `copy.deepcopy` of the trained model: the copy
    must keep the wraps (checkpointing, then compile) around its own blocks, not the original's."""
    plain, wrapped = _pair(ModelConfig.tiny())
    apply_compile(wrapped)
    twin = copy.deepcopy(wrapped)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(1.5)
    fresh = copy.deepcopy(plain)  # never wrapped: the reference for the scaled weights
    fresh.load_state_dict(twin.state_dict())
    tokens = torch.randint(0, 256, (2, 12))
    _assert_same(_grads(fresh, tokens), _grads(twin, tokens))
    _assert_same(_grads(plain, tokens), _grads(wrapped, tokens))  # the original is untouched
    for a, b in zip(wrapped.layers, twin.layers, strict=True):
        assert b.checkpointed and len(b._forward_wraps) == len(a._forward_wraps) == 2
    again = copy.deepcopy(twin)  # a copy of a copy
    _assert_same(_grads(fresh, tokens), _grads(again, tokens))


def test_an_moe_block_recomputes_its_forwards_routing_and_counts_it_once():
    plain, recomputed = _pair(ModelConfig.tiny(n_layers=3, moe=MOE))
    tokens = torch.randint(0, 256, (2, 12))
    _assert_same(_grads(plain, tokens), _grads(recomputed, tokens))
    for a, b in zip(moe_layers(plain), moe_layers(recomputed), strict=True):
        assert torch.equal(a.tokens_per_expert, b.tokens_per_expert)  # not counted again
        assert b.tokens_per_expert.sum() == 2 * 11 * MOE.top_k
        assert torch.equal(a.last_indices, b.last_indices)

    # Router replay for the forward only: backward runs after the context has closed, and
    # the recomputation still takes the replayed experts, not the ones the router prefers.
    g = torch.Generator().manual_seed(1)
    replay = [torch.rand(2, 11, MOE.n_routed_experts, generator=g).argsort(-1)[..., :MOE.top_k]
              for _ in moe_layers(plain)]
    grads = []
    for model in (plain, recomputed):
        model.zero_grad(set_to_none=True)
        with router_replay(model, replay):
            logits = model(tokens[:, :-1])
        assert all(torch.equal(r, i) for r, i in zip(recorded_routing(model), replay, strict=True))
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        assert all(m.replay_indices is None for m in moe_layers(model))
    _assert_same(*grads)


def test_only_a_model_of_blocks_is_checkpointed():
    with pytest.raises(ValueError, match="no `layers` ModuleList of blocks"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2))


def test_an_moe_block_recomputes_its_balance_loss_over_the_tokens_it_counted():
    """The tokens the balance loss counts (a forward's text, not its padding) are given for
    the forward only: the recomputation in backward counts the same ones."""
    plain, recomputed = _pair(ModelConfig.tiny(n_layers=3, moe=MOE))
    tokens = torch.randint(0, 256, (2, 12))
    docs = torch.tensor([[0] * 11, [0] * 6 + [-1] * 5])
    grads = []
    for model in (plain, recomputed):
        model.zero_grad(set_to_none=True)
        with counting_tokens(model, docs >= 0):
            model.hidden(tokens[:, :-1], doc_ids=docs)
        aux = moe_aux_loss(model)
        assert aux is not None and all(m.counted is None for m in moe_layers(model))
        aux.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    _assert_same(*grads)
