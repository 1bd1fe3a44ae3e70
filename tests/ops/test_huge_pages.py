"""Huge-page memory: moving a model there keeps every value and every Parameter, each tensor keeps
a storage of its own, and the kernel is asked for 2 MB pages (the mapping carries the advice)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from codedojo.model.config import ModelConfig
from codedojo.model.hf import save_hf
from codedojo.model.transformer import Transformer
from codedojo.model.weights import load_model
from codedojo.ops import huge_page_empty, move_to_huge_pages


def mapping(t: torch.Tensor) -> dict[str, str]:
    """/proc/self/smaps of the mapping holding ``t``'s first byte: its fields, and ``perms``."""
    addr, found = t.data_ptr(), None
    with open("/proc/self/smaps") as f:
        for line in f:
            head, *rest = line.split()
            if "-" in head and not head.endswith(":"):
                if found is not None:
                    return found
                lo, hi = (int(v, 16) for v in head.split("-"))
                found = {"perms": rest[0], "range": head} if lo <= addr < hi else None
            elif found is not None:
                found[head.rstrip(":")] = " ".join(rest)
    if found is None:
        raise AssertionError(f"no mapping holds address {addr:#x}")
    return found


def advised_huge(t: torch.Tensor) -> bool:
    """Whether ``t`` lies in private memory advised huge pages (``hg`` in its VmFlags)."""
    m = mapping(t)
    return m["perms"].endswith("p") and "hg" in m["VmFlags"].split()


def thp_mode() -> str:
    """always, madvise or never: the system's transparent huge pages."""
    text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    return text[text.index("[") + 1: text.index("]")]


def tiny_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.tiny())


def test_an_empty_tensor_needs_no_mapping() -> None:
    assert huge_page_empty((0, 4), torch.float32).shape == (0, 4)


def test_an_empty_parameter_takes_the_new_type_too() -> None:
    m = torch.nn.Module()
    m.a, m.b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(0))
    m.ids = torch.nn.Parameter(torch.zeros(0, dtype=torch.long), requires_grad=False)
    move_to_huge_pages(m, torch.bfloat16)
    assert (m.a.dtype, m.b.dtype, m.ids.dtype) == (torch.bfloat16, torch.bfloat16, torch.long)


def test_a_gradient_follows_its_parameters_new_type() -> None:
    lin = torch.nn.Linear(4, 4)
    lin(torch.randn(2, 4)).sum().backward()
    move_to_huge_pages(lin, torch.bfloat16)
    assert lin.weight.dtype == lin.weight.grad.dtype == torch.bfloat16
    torch.optim.SGD(lin.parameters(), lr=0.1).step()


def test_move_keeps_values_and_parameters_and_training_updates_the_new_memory() -> None:
    model = tiny_model()
    params = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # holds the Parameter objects
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 7))
    with torch.no_grad():
        logits = model(tokens)
    # Where they were: the heap, or whatever the process's earlier allocations left there (a
    # region may already carry the advice, so the test asks for a new mapping, not a change of
    # advice).
    was = {mapping(p)["range"] for p in params.values()}

    moved = move_to_huge_pages(model)

    assert moved >= sum(p.numel() * p.element_size() for p in params.values())
    now = {mapping(p)["range"] for p in params.values()}
    assert len(now) == 1 and not now & was  # one new mapping holds them all
    for name, p in model.named_parameters():
        assert p is params[name] and p.requires_grad
        assert torch.equal(p, before[name]) and advised_huge(p)
    with torch.no_grad():
        assert torch.equal(model(tokens), logits)
    model(tokens).logsumexp(-1).mean().backward()
    opt.step()
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert changed and all(advised_huge(params[n]) for n in changed)


def test_moved_parameters_save_and_load_as_before(tmp_path) -> None:
    model = tiny_model()
    move_to_huge_pages(model)
    sd = {k: v for k, v in model.state_dict().items() if not k.startswith("rotary")}
    save_file(sd, str(tmp_path / "m.safetensors"))  # refuses tensors sharing a storage
    back = load_file(str(tmp_path / "m.safetensors"))
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)


def test_load_model_holds_its_weights_in_huge_pages(tmp_path) -> None:
    cfg = ModelConfig.tiny()
    ours = tiny_model()
    model, _ = load_model(save_hf(ours, cfg, tmp_path / "hf"))
    loaded = dict(model.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.equal(loaded[name], p) and advised_huge(loaded[name])
    bf16, _ = load_model(tmp_path / "hf", dtype=torch.bfloat16)
    halved = dict(bf16.named_parameters())
    for name, p in ours.named_parameters():  # converted on the way into huge pages
        assert halved[name].dtype == torch.bfloat16 and advised_huge(halved[name])
        assert torch.equal(halved[name], p.to(torch.bfloat16))
    assert all(b.dtype == torch.bfloat16 for b in bf16.rotary.buffers())  # as the weights


def test_a_built_moe_model_starts_its_expert_counts_at_zero() -> None:
    """Unsaved buffers are made, not left as whatever memory held: a trained MoE model adds its
    routing to `tokens_per_expert` and balances on it."""
    from codedojo.model.moe import moe_layers
    from codedojo.model.weights import build_model
    from tests.engine.tiny_moe import tiny_moe

    ours = tiny_moe()
    for m in moe_layers(ours):
        m.expert_bias.uniform_(-1, 1)  # saved with the weights
    sd = {k: v.clone() for k, v in ours.state_dict().items()}
    built = build_model(sd, ours.cfg)
    for a, b in zip(moe_layers(ours), moe_layers(built), strict=True):
        assert torch.equal(a.expert_bias, b.expert_bias)
        assert torch.equal(b.tokens_per_expert, torch.zeros_like(a.tokens_per_expert))
    tokens = torch.randint(0, ours.cfg.vocab_size, (2, 9))
    with torch.no_grad():
        assert torch.equal(built(tokens), ours(tokens))
    del sd["layers.1.attn.wo.weight"]
    with pytest.raises(RuntimeError, match="Missing key.*layers.1.attn.wo.weight"):
        build_model(sd, ours.cfg)


def test_the_memory_is_backed_by_huge_pages_where_the_system_has_them() -> None:
    t = huge_page_empty((16 << 20,), torch.float32).fill_(1.0)  # 64 MB, every page touched
    huge_kb = int(mapping(t)["AnonHugePages"].split()[0])
    if thp_mode() == "never":
        assert huge_kb == 0
    else:  # the kernel compacts memory for advised regions: all of it, or nearly
        assert huge_kb >= 32 << 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_huge_page_empty(dtype: torch.dtype) -> None:
    t = huge_page_empty((3, 1000), dtype)
    assert t.shape == (3, 1000) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % (2 << 20) == 0 and advised_huge(t)
    t.fill_(2.0)
    assert bool((t == 2.0).all())
