from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from codedojo.data.packing import make_batch, pack
from codedojo.model.config import ModelConfig
from codedojo.model.transformer import Transformer


def test_document_loss_same_packed_as_alone():
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(vocab_size=64, n_layers=2)).eval()
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 64, size=n) for n in (9, 14, 5, 20, 11)]
    p = pack(docs, seq_len=30, allow_split=False)  # rows of 31: no document is split
    b = make_batch(p.tokens, p.segments, p.mask)
    with torch.no_grad():
        logits = model(b["tokens"], positions=b["positions"], doc_ids=b["doc_ids"])
        ce = F.cross_entropy(logits.transpose(1, 2), b["targets"], reduction="none")  # (B, T)
        packed_losses = []
        for r in range(ce.shape[0]):
            for s in b["doc_ids"][r].unique():
                if s < 0:
                    continue
                sel = (b["doc_ids"][r] == s) & b["loss_mask"][r]
                packed_losses.append(float(ce[r][sel].sum()))
        alone = []
        for d in docs:
            x = torch.as_tensor(d)[None]
            lg = model(x[:, :-1])
            alone.append(float(F.cross_entropy(lg[0], x[0, 1:], reduction="sum")))
    assert len(packed_losses) == len(alone)
    np.testing.assert_allclose(sorted(packed_losses), sorted(alone), rtol=1e-5)
    # without the document mask and restarting positions the losses differ (the test has teeth)
    with torch.no_grad():
        leaky = model(b["tokens"])
    assert not torch.allclose(leaky, logits, atol=1e-4)
