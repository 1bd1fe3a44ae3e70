from __future__ import annotations

import pytest
import torch

from codedojo.model.config import ModelConfig, MoEConfig
from codedojo.model.moe import (
    MoE,
    moe_aux_loss,
    moe_layers,
    recorded_routing,
    router_replay,
    upcycle_mlp,
    update_moe_biases,
)

pytestmark = pytest.mark.usefixtures("one_thread")

def _cfg(**kw) -> ModelConfig:
    moe = dict(n_routed_experts=8, top_k=2, expert_ffn_dim=16, n_shared_experts=1,
               route_scale=1.0, seq_aux_loss_coef=0.0)
    moe.update(kw)
    return ModelConfig.tiny(dim=24, moe=MoEConfig(**moe))


def test_fast_matches_reference_forward_and_grads():
    torch.manual_seed(0)
    m = MoE(_cfg())
    x = torch.randn(2, 7, 24, requires_grad=True)
    fast = m(x)
    gf = torch.autograd.grad(fast.square().sum(), [x, m.w1, m.w2, m.router.weight])
    ref = m.forward_reference(x)
    gr = torch.autograd.grad(ref.square().sum(), [x, m.w1, m.w2, m.router.weight])
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(gf, gr, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def _skewed(T: int) -> torch.Tensor:
    """(1, T, 2) expert ids: every token on expert 0, nearly all also on 1, a few on 5, the
    other experts idle."""
    second = torch.ones(T, dtype=torch.long)
    second[::7] = 5
    return torch.stack([torch.zeros(T, dtype=torch.long), second], -1)[None]


def test_fast_matches_reference_under_skewed_routing():
    torch.manual_seed(7)
    m = MoE(_cfg())
    x = torch.randn(1, 40, 24, requires_grad=True)
    params = [x, m.w1, m.w3, m.w2, m.router.weight, m.shared_w1.weight]
    idx = _skewed(40)
    with router_replay(m, [idx]):
        fast = m(x)
        assert torch.equal(recorded_routing(m)[0], idx)
        gf = torch.autograd.grad(fast.square().sum(), params)
        ref = m.forward_reference(x)
        gr = torch.autograd.grad(ref.square().sum(), params)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(gf, gr, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    busy = torch.tensor([1, 1, 0, 0, 0, 1, 0, 0], dtype=torch.bool)
    for g in gf[1:4]:  # expert weights: the busy experts learn, the idle ones not at all
        assert torch.equal(g.flatten(1).abs().amax(1) > 0, busy)
    assert m(torch.randn(2, 0, 24)).shape == (2, 0, 24)  # no tokens at all


def test_expert_work_is_that_of_the_routed_tokens_however_skewed():
    """Each expert multiplies only the tokens routed to it: the same flops with all tokens
    on one expert as spread evenly, not every expert padded to the busiest one's load."""
    from torch.utils.flop_counter import FlopCounterMode

    E, k, D, H, T = 8, 2, 24, 16, 64
    m = MoE(_cfg(n_shared_experts=0))
    x = torch.randn(1, T, D)
    even = torch.stack([torch.arange(T) % E, (torch.arange(T) + 1) % E], -1)[None]
    want = 2 * T * D * E + 2 * T * k * 3 * D * H  # router, then gate, up and down projections
    for idx in (even, _skewed(T)):
        with torch.no_grad(), router_replay(m, [idx]), FlopCounterMode(display=False) as fc:
            m(x)
        assert fc.get_total_flops() == want


def test_compiled_forward_compiles_once_however_the_tokens_spread():
    """Under torch.compile (the trainer compiles each block), how many tokens each expert gets
    is data: new idle or one-token experts must not compile new graphs (a graph each would
    reach the recompile limit, and the block would run eager). The compiled forward and its
    gradients are the eager ones."""
    import torch._dynamo

    E, T = 4, 8
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    m = MoE(_cfg(n_routed_experts=E))
    compiled = torch.compile(m.forward, backend=backend, dynamic=True)
    x = torch.randn(1, T, 24, requires_grad=True)
    spreads = [torch.arange(2 * T) % E,  # every expert busy
               torch.tensor([0, 1, 0, 2, 1, 2] * 2 + [0, 1] * 2),  # expert 3 idle
               torch.tensor([0, 1, 0, 2, 1, 2, 0, 3] + [0, 1, 2, 0] * 2),  # expert 3 has one
               torch.tensor([0, 1] * T),  # experts 2 and 3 idle
               torch.tensor([0, 3, 1, 3, 0, 2] + [0, 1, 3, 1, 0, 3] + [0, 3, 1, 3])]  # 2 has one
    for i, spread in enumerate(spreads):
        with router_replay(m, [spread.reshape(1, T, 2)]):
            out = compiled(x)
            (got,) = torch.autograd.grad(out.square().sum(), [m.w1])
            want = m(x)
            (grad,) = torch.autograd.grad(want.square().sum(), [m.w1])
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got, grad, rtol=1e-5, atol=1e-6)
        if i == 0:
            first = len(graphs)
    assert first > 0 and len(graphs) == first


def test_bias_changes_selection_not_gates():
    torch.manual_seed(1)
    m = MoE(_cfg(n_shared_experts=0))
    x = torch.randn(1, 5, 24)
    idx0, gates0, scores = m.route(x.reshape(-1, 24))
    m.expert_bias[3] = 100.0  # expert 3 now always selected
    idx1, gates1, _ = m.route(x.reshape(-1, 24))
    assert (idx1 == 3).any(-1).all()
    sel = scores.gather(-1, idx1)
    torch.testing.assert_close(gates1, sel / sel.sum(-1, keepdim=True))  # raw affinities only


def test_one_expert_a_token_gates_by_its_affinity_and_the_router_learns():
    """Normalised over one expert, a gate would be 1 whatever the router said: it is the
    affinity itself, and the task loss reaches the router as with two."""
    grads = []
    for k in (1, 2):
        torch.manual_seed(0)
        m = MoE(_cfg(top_k=k, n_shared_experts=0))
        x = torch.randn(2, 7, 24)
        idx, gates, scores = m.route(x.reshape(-1, 24))
        if k == 1:
            torch.testing.assert_close(gates, scores.gather(-1, idx))
        m(x).square().sum().backward()
        grads.append(float(m.router.weight.grad.abs().sum()))
    assert grads[0] > grads[1] / 10, grads  # normalised, one gate had 1e-11 (rounding)


def test_bias_update_moves_toward_balance():
    m = MoE(_cfg())
    m.train()
    m.tokens_per_expert.copy_(torch.tensor([10.0, 0, 0, 0, 0, 0, 0, 6]))
    update_moe_biases(m, gamma=0.01)
    assert m.expert_bias[0] < 0 and m.expert_bias[1] > 0 and m.expert_bias[7] < 0
    assert m.tokens_per_expert.sum() == 0


def test_balancing_state_stays_float32_when_the_model_is_cast():
    """A bfloat16 model keeps a float32 bias: a step of 1e-3 on 0.5 would round away, and the
    bias must route as the float32 trainer's does."""
    m = MoE(_cfg())
    m.expert_bias.fill_(0.5)
    m.expert_bias[1] += 1e-3
    want = m.expert_bias.clone()
    m.to(torch.bfloat16)
    assert m.w1.dtype == torch.bfloat16 and m.router.weight.dtype == torch.bfloat16
    assert m.expert_bias.dtype == m.tokens_per_expert.dtype == torch.float32
    assert torch.equal(m.expert_bias, want)
    m.train()
    m.tokens_per_expert.fill_(300.0)
    m(torch.randn(1, 4, 24, dtype=torch.bfloat16))
    assert m.tokens_per_expert.sum() == 8 * 300 + 4 * 2  # counts past 256 still add up
    m.float()
    assert torch.equal(m.expert_bias, want)


def test_router_replay_uses_given_indices_and_router_gets_grads():
    torch.manual_seed(2)
    m = MoE(_cfg())
    x = torch.randn(2, 4, 24)
    m(x)
    chosen = recorded_routing(m)
    forced = [(chosen[0] + 1) % 8]
    with router_replay(m, forced):
        y = m(x)
        assert torch.equal(recorded_routing(m)[0], forced[0])
    y.sum().backward()
    assert m.router.weight.grad is not None and m.router.weight.grad.abs().sum() > 0
    assert m.replay_indices is None
    with pytest.raises(ValueError, match="2 index tensors for 1"):
        with router_replay(m, forced * 2):
            pass
    # recorded routing that cannot be this input's is named, not an index error deep inside
    # (nor, where only the count of ids fits, taken as some other tokens' or slots' experts)
    x_shape = r"for a forward of 2x4 tokens of top_k 2: must be \(2, 4, 2\)$"
    for bad, why in ((forced[0] + 8, r"expert ids \d+\.\.\d+ outside \[0, 8\)"),
                     (forced[0] * 0, "a token's experts must differ"),
                     (forced[0] + 0.7, "expert ids must be integers, got torch.float32"),
                     (forced[0].reshape(16, 1), r"\(16, 1\) must be \(B, T, 2\) or \(T, 2\)"),
                     (forced[0].reshape(8, 2), r"replay_indices: \(8, 2\) " + x_shape),
                     (forced[0].reshape(4, 2, 2), r"replay_indices: \(4, 2, 2\) " + x_shape),
                     (forced[0][:, :3], r"replay_indices: \(2, 3, 2\) " + x_shape)):
        with pytest.raises(ValueError, match=why), router_replay(m, [bad]):
            m(x)
    with router_replay(m, [forced[0][0].to(torch.int16)]):  # one sequence's rows as (T, k)
        torch.testing.assert_close(m(x[:1]), m.forward_reference(x[:1]))
        assert torch.equal(recorded_routing(m)[0], forced[0][:1])


def test_the_router_scores_in_float32_in_a_bfloat16_model():
    """Router logits rounded to bfloat16 (8 bits of mantissa) would make some tokens pick
    other experts than the same weights' exact scores do, and tie."""
    torch.manual_seed(0)
    m = MoE(_cfg(n_routed_experts=16, top_k=4)).to(torch.bfloat16)
    x = torch.randn(256, 24).to(torch.bfloat16)
    idx, _, scores = m.route(x)
    want = torch.sigmoid(x.float() @ m.router.weight.float().T)
    torch.testing.assert_close(scores, want)
    assert torch.equal(idx, torch.topk(want + m.expert_bias, 4, dim=-1).indices)


def test_model_init_reaches_the_moe_layers_so_wrong_routing_shows():
    """`Transformer.init_weights(std)` initialises the MoE layers at that std, their down
    projections at the residual-output std. Left at 0.02 under a model at 0.5, the experts
    would hardly move the logits, and a replay one token off would pass a 1e-4 check."""
    from tests.engine.tiny_moe import tiny_moe

    model = tiny_moe()  # init_weights(std=0.5)
    out_std = 0.5 / (2 * model.cfg.n_layers) ** 0.5
    for layer in moe_layers(model):
        for w, std in ((layer.router.weight, 0.5), (layer.w1, 0.5), (layer.w3, 0.5),
                       (layer.w2, out_std), (layer.shared_w1.weight, 0.5),
                       (layer.shared_w2.weight, out_std)):
            got = float(w.detach().std())
            assert abs(got / std - 1) < 0.2, (tuple(w.shape), got, std)
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logp = torch.log_softmax(model(ids), -1)
        late = [torch.cat([r[:, :1], r[:, :-1]], 1) for r in recorded_routing(model)]
        with router_replay(model, late):  # each token given the experts of the one before
            off = torch.log_softmax(model(ids), -1)
    assert float((logp - off).abs().max()) > 0.1


def test_sequence_aux_loss_prefers_balance():
    torch.manual_seed(3)
    m = MoE(_cfg(seq_aux_loss_coef=0.01))
    m.train()
    m(torch.randn(2, 16, 24))
    balanced = float(moe_aux_loss(m).detach())
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[0] += 1.0  # one expert dominates the affinities
    m(torch.randn(2, 16, 24).abs())
    assert float(moe_aux_loss(m).detach()) > balanced


def test_upcycled_moe_equals_dense_then_trains():
    torch.manual_seed(4)
    D, Fd = 24, 32
    wg, wu, wd = torch.randn(Fd, D) * 0.1, torch.randn(Fd, D) * 0.1, torch.randn(D, Fd) * 0.1
    m = upcycle_mlp(wg, wu, wd, MoE(_cfg(expert_ffn_dim=16, n_shared_experts=2)))
    x = torch.randn(3, 5, D)
    dense = (torch.nn.functional.silu(x @ wg.T) * (x @ wu.T)) @ wd.T
    torch.testing.assert_close(m(x), dense, rtol=1e-5, atol=1e-6)


def test_tiny_moe_trains_and_balances():
    torch.manual_seed(5)
    m = MoE(_cfg(seq_aux_loss_coef=1e-3))
    m.train()
    x, y = torch.randn(4, 8, 24), torch.randn(4, 8, 24)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    for _ in range(60):
        loss = (m(x) - y).square().mean() + moe_aux_loss(m)
        opt.zero_grad()
        loss.backward()
        opt.step()
        update_moe_biases(m, 1e-3)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
    assert m.expert_bias.abs().sum() > 0


def test_tiny_moe_transformer_upcycled_then_trained():
    from codedojo.model.moe import upcycle_model
    from codedojo.model.transformer import Transformer

    torch.manual_seed(6)
    dense = Transformer(ModelConfig.tiny(vocab_size=64, ffn_dim=64)).eval()
    moe_cfg = MoEConfig(n_routed_experts=4, top_k=2, expert_ffn_dim=32, n_shared_experts=2,
                        first_dense_layers=1, seq_aux_loss_coef=1e-3)
    model = upcycle_model(dense, moe_cfg).eval()
    x = torch.randint(0, 64, (2, 12))
    torch.testing.assert_close(model(x), dense(x), rtol=1e-4, atol=1e-5)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        loss = loss + moe_aux_loss(model)
        opt.zero_grad()
        loss.backward()
        opt.step()
        update_moe_biases(model, moe_cfg.bias_update_speed)
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    assert len(recorded_routing(model)) == 1  # one MoE layer after the dense first layer


def test_balancing_counts_the_text_not_the_padding():
    """Rows of 16 tokens of text and 48 of padding (one token, which would pile onto a few
    experts), and one of padding alone: the load that moves the biases and the balance loss
    are the text's alone."""
    from codedojo.model.moe import counting_tokens
    from codedojo.model.transformer import Transformer

    torch.manual_seed(0)
    cfg = ModelConfig.tiny(n_layers=2, moe=MoEConfig(n_routed_experts=8, top_k=2,
                                                     expert_ffn_dim=16, first_dense_layers=1,
                                                     seq_aux_loss_coef=0.01))
    model = Transformer(cfg).train()
    (m,) = moe_layers(model)
    text = torch.randint(1, cfg.vocab_size, (4, 16))
    with torch.no_grad():
        model.hidden(text)
        want_counts, want_aux = m.tokens_per_expert.clone(), m.aux_loss
        m.tokens_per_expert.zero_()
        padded = torch.cat([text, torch.zeros(4, 48, dtype=torch.long)], 1)
        docs = torch.cat([torch.zeros(4, 16), torch.full((4, 48), -1)], 1).long()
        # and a row of padding alone: no sequence of the balance loss's mean
        padded = torch.cat([padded, torch.zeros(1, 64, dtype=torch.long)])
        docs = torch.cat([docs, torch.full((1, 64), -1)])
        with counting_tokens(model, docs >= 0):
            model.hidden(padded, doc_ids=docs)
    assert m.counted is None  # (for the block only)
    assert torch.equal(m.tokens_per_expert, want_counts) and want_counts.sum() == 4 * 16 * 2
    torch.testing.assert_close(m.aux_loss, want_aux)
