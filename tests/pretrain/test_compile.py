from __future__ import annotations

import copy

import torch
from torch._dynamo.utils import counters

from codedojo.model.kv_cache import KVCache
from codedojo.pretrain.parallel import apply_compile
from codedojo.pretrain.trainer import build_model, train_stage
from tests.pretrain.test_trainer import _cfg, _loader


def test_compiled_blocks_train_like_eager_and_leave_decoding_alone(tmp_path):
    """Packed rows (document masks) with MTP trained jointly: the compiled step follows the
    eager one; names are unchanged; a cached forward never enters the compiled graphs."""
    torch._dynamo.reset()
    cfg = _cfg(tmp_path, mtp="joint", steps=3, checkpoint_every=100)
    torch.manual_seed(0)
    model, mtp = build_model(cfg)
    model_c, mtp_c = copy.deepcopy(model), copy.deepcopy(mtp)
    names = list(model_c.state_dict())
    apply_compile(model_c, mtp_c)
    assert list(model_c.state_dict()) == names

    eager = train_stage(cfg, 0, model, mtp, _loader(), tmp_path / "a")
    compiled = train_stage(cfg, 0, model_c, mtp_c, _loader(), tmp_path / "b")
    assert counters["stats"]["unique_graphs"] > 0  # the compiled path did run
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-4, atol=1e-5)
    for (n, p), (_, q) in zip(model.named_parameters(), model_c.named_parameters(), strict=True):
        # Adam turns rounding-sized gradient differences into up to lr-sized steps where the
        # gradient is near zero; 1e-4 is 1% of one step at lr 1e-2
        torch.testing.assert_close(q, p, rtol=0, atol=1e-4, msg=n)

    graphs = counters["stats"]["unique_graphs"]
    model.eval(), model_c.eval()
    tokens = torch.randint(1, 64, (2, 5))
    with torch.no_grad():
        out = [m(tokens, cache=KVCache(m.cfg, n_slots=2, max_len=16).view(0, 2))
               for m in (model, model_c)]
    # the weights may differ by the 1e-4 above, and the logits by as much
    torch.testing.assert_close(out[1], out[0], rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == graphs
