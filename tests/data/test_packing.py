from __future__ import annotations

import numpy as np
import pytest
import torch

from codedojo.data.mixture import MixtureSource, mix
from codedojo.data.packing import PackedLoader, make_batch, pack
from codedojo.data.readers import Document
from codedojo.data.shards import ShardWriter, TokenShards, tokenize_to_shards


def test_shards_roundtrip_across_files(tmp_path, byte_tok):
    docs = [Document("abc" * (i + 1), str(i)) for i in range(10)]
    tokenize_to_shards(docs, byte_tok, tmp_path, 257, 0, shard_tokens=20)
    sh = TokenShards(tmp_path)
    assert len(sh.index["shards"]) > 1 and len(sh) == 10
    for i, d in enumerate(docs):
        assert byte_tok.decode(sh.doc(i).tolist()) == d.text
        assert sh.doc(i)[-1] == 0
    assert sh.num_tokens == sum(len(d.text) + 1 for d in docs)


def test_pack_segments_positions_and_loss_mask():
    docs = [np.arange(1, 4), np.arange(10, 16), np.arange(20, 22)]  # lengths 3, 6, 2
    p = pack(docs, seq_len=4)
    # rows of 5: [1 2 3 10 11] [11 12 13 14 15] [20 21 pad...]: the cut token 11, only a
    # target in the first row, opens the second
    assert p.tokens.tolist() == [[1, 2, 3, 10, 11], [11, 12, 13, 14, 15], [20, 21, 0, 0, 0]]
    b = make_batch(p.tokens, p.segments, p.mask)
    assert b["positions"][0].tolist() == [0, 1, 2, 0]
    assert b["positions"][1].tolist() == [0, 1, 2, 3]
    assert b["doc_ids"][1].tolist() == [0, 0, 0, 0]
    # 3 -> 10 crosses documents: not trained
    assert b["loss_mask"][0].tolist() == [True, True, False, True]
    assert b["loss_mask"][1].tolist() == [True, True, True, True]
    assert b["loss_mask"][2].tolist() == [True, False, False, False]
    # every within-document transition is trained exactly once, across the cut too
    trained = [(int(x), int(y)) for x, y, m in zip(b["tokens"].flatten(), b["targets"].flatten(),
                                                    b["loss_mask"].flatten(), strict=True) if m]
    assert sorted(trained) == [(1, 2), (2, 3), *((t, t + 1) for t in range(10, 15)), (20, 21)]


def test_sft_mask_survives_packing(tmp_path):
    w = ShardWriter(tmp_path, 100, None)
    w.add([5, 6, 7, 8], [0, 0, 1, 1])
    w.add([9, 10, 11], [0, 1, 1])
    w.close()
    docs = list(mix([MixtureSource(name="s", path=str(tmp_path))], total_tokens=7, seed=0))
    p = pack(docs, seq_len=6)
    b = make_batch(p.tokens, p.segments, p.mask)
    trained = {(int(x), int(y)) for x, y, m in zip(b["tokens"][0], b["targets"][0],
                                                    b["loss_mask"][0], strict=True) if m}
    # the mask marks target tokens: 7, 8 of the first example and 10, 11 of the second
    assert trained == {(6, 7), (7, 8), (9, 10), (10, 11)}


def test_a_conversation_is_not_cut_to_fill_a_row(tmp_path):
    """Masked documents (conversations) that do not fit the rest of a row start the next one
    whole, so an answer is learnt with its prompt and its end token is a target; only one
    longer than a row is split. Unmasked text still fills every row."""
    w = ShardWriter(tmp_path / "chats", 100, None)
    w.add([11, 12, 13, 14, 15, 99], [0, 0, 0, 1, 1, 1])
    w.add([21, 22, 23, 24, 25, 99], [0, 0, 0, 1, 1, 1])
    w.close()
    chats = MixtureSource(name="chats", path=str(tmp_path / "chats"))
    p = pack(mix([chats], total_tokens=12, seed=0), seq_len=9)  # rows of 10
    b = make_batch(p.tokens, p.segments, p.mask)
    for row in range(2):
        trained = [int(y) for y, m in zip(b["targets"][row], b["loss_mask"][row], strict=True)
                   if m]
        assert trained in ([14, 15, 99], [24, 25, 99])  # each answer whole, in its own row
        assert p.tokens[row].tolist()[6:] == [0] * 4  # the rest of the row: padding
    long = pack(mix([chats], total_tokens=12, seed=0), seq_len=3)  # longer than a row: split
    b = make_batch(long.tokens, long.segments, long.mask)
    trained = {(int(x), int(y)) for x, y, m in zip(b["tokens"].flatten(), b["targets"].flatten(),
                                                    b["loss_mask"].flatten(), strict=True) if m}
    assert trained == {(13, 14), (14, 15), (15, 99), (23, 24), (24, 25), (25, 99)}  # (and cut)
    w = ShardWriter(tmp_path / "text", 100, None)
    w.add([1, 2, 3, 4, 5, 6])
    w.add([7, 8, 9, 10, 11, 12])
    w.close()
    text = pack(mix([MixtureSource(name="t", path=str(tmp_path / "text"))], 12, seed=0),
                seq_len=9)
    assert 0 not in text.tokens[0].tolist()  # split to fill the row


def test_context_tokens_are_never_trained_targets(tmp_path):
    """A source's ``context_tokens``: the first n tokens of each document are read, never
    learnt; with a mask of its own (SFT), both apply, and the stored mask is left as it was."""
    w = ShardWriter(tmp_path / "plain", 100, None)
    w.add([5, 6, 7, 8, 9])
    w.add([20, 21, 22])
    w.close()
    w = ShardWriter(tmp_path / "masked", 100, None)
    w.add([5, 6, 7, 8, 9], [1, 1, 1, 0, 1])
    w.close()

    def trained(name: str, context: int) -> set[tuple[int, int]]:
        src = MixtureSource(name=name, path=str(tmp_path / name), context_tokens=context)
        p = pack(mix([src], total_tokens=8, seed=0), seq_len=16, allow_split=False)
        b = make_batch(p.tokens, p.segments, p.mask)
        return {(int(x), int(y)) for x, y, m in zip(b["tokens"].flatten(), b["targets"].flatten(),
                                                    b["loss_mask"].flatten(), strict=True) if m}

    assert trained("plain", 0) == {(5, 6), (6, 7), (7, 8), (8, 9), (20, 21), (21, 22)}
    assert trained("plain", 2) == {(6, 7), (7, 8), (8, 9), (21, 22)}
    assert trained("plain", 3) == {(7, 8), (8, 9)}  # a document of only context: nothing
    assert trained("masked", 2) == {(6, 7), (8, 9)}
    assert TokenShards(tmp_path / "masked").mask(0).tolist() == [1, 1, 1, 0, 1]


def test_mixture_tracks_token_weights(tmp_path):
    for name, n in (("a", 3), ("b", 50)):
        w = ShardWriter(tmp_path / name, 100, None)
        for i in range(n):
            w.add([1 + i % 50] * (10 if name == "a" else 4))
        w.close()
    srcs = [MixtureSource(name="a", path=str(tmp_path / "a"), weight=3),
            MixtureSource(name="b", path=str(tmp_path / "b"), weight=1)]
    got = np.zeros(2)
    for d in mix(srcs, 4000, seed=1):
        got[d.source] += d.tokens.size
    assert abs(got[0] / got.sum() - 0.75) < 0.01
    first = [d.tokens.tolist() for d in mix(srcs, 200, seed=1)]
    assert first == [d.tokens.tolist() for d in mix(srcs, 200, seed=1)]


def test_loader_resume_is_exact():
    p = pack([np.arange(1, 200)], seq_len=8)
    a = PackedLoader(p, batch_size=3, seed=4)
    for _ in range(9):  # crosses an epoch boundary
        a.next_batch()
    b = PackedLoader(p, batch_size=3, seed=4)
    b.load_state_dict(a.state_dict())
    for _ in range(5):
        x, y = a.next_batch(), b.next_batch()
        assert all(torch.equal(x[k], y[k]) for k in x)


def test_ranks_share_out_the_rows_of_an_epoch():
    p = pack([np.arange(1, 196)], seq_len=8)
    assert len(p) == 25
    alone = PackedLoader(p, batch_size=3, seed=4)
    ranks = [PackedLoader(p, batch_size=3, seed=4, rank=r, world=3) for r in range(3)]
    rows = [set(ld.epoch_rows.tolist()) for ld in ranks]
    assert [len(r) for r in rows] == [8, 8, 8]
    assert len(set.union(*rows)) == 24 and set.union(*rows) <= set(alone.epoch_rows.tolist())
    # the batches hold the rank's own rows
    for ld, own in zip(ranks, rows, strict=True):
        batch = ld.next_batch()["tokens"]
        assert {tuple(r) for r in batch.tolist()} <= {tuple(p.tokens[i, :-1]) for i in own}
    # the next epoch draws a new order and shares it out again; a resume finds it
    for _ in range(3):
        ranks[1].next_batch()
    assert ranks[1].epoch == 1
    again = PackedLoader(p, batch_size=3, seed=4, rank=1, world=3)
    again.load_state_dict(ranks[1].state_dict())
    first = PackedLoader(p, batch_size=3, seed=4, rank=0, world=3)
    first.load_state_dict({"epoch": 1, "pos": 0})
    assert np.array_equal(again.epoch_rows, ranks[1].epoch_rows)
    assert not set(again.epoch_rows.tolist()) & set(first.epoch_rows.tolist())
    assert set(again.epoch_rows.tolist()) != rows[1]
    with pytest.raises(ValueError, match="on each of 9 ranks"):
        PackedLoader(p, batch_size=3, world=9)
    with pytest.raises(ValueError, match="rank 3 is not one of 3"):
        PackedLoader(p, batch_size=1, rank=3, world=3)


def test_pack_without_splitting():
    p = pack([np.arange(1, 4), np.arange(10, 15), np.arange(20, 22)], seq_len=5,
             allow_split=False)
    assert p.tokens.tolist() == [[1, 2, 3, 0, 0, 0], [10, 11, 12, 13, 14, 0], [20, 21, 0, 0, 0, 0]]


def test_origins_bring_each_token_its_stored_vector(tmp_path):
    """Packed with origins, every token knows its place in the source's token stream (across
    shard files, documents split between rows), and a loader with features stored beside the
    source hands each input token its own vector."""
    from codedojo.data.features import FeatureWriter, TokenFeatures

    rng = np.random.default_rng(0)
    w = ShardWriter(tmp_path / "src", 64, eos_id=None, shard_tokens=50)
    for n in rng.integers(3, 30, size=20):
        w.add(rng.integers(1, 64, size=n))
    sh = TokenShards(w.close())
    assert len(sh.index["shards"]) > 2
    stream = np.concatenate([sh.doc(i) for i in range(len(sh))])
    assert [sh.doc_start(i) for i in (0, 1, len(sh) - 1)] == [
        0, len(sh.doc(0)), len(stream) - len(sh.doc(len(sh) - 1))]
    src = MixtureSource(name="s", path=str(tmp_path / "src"))
    p = pack(mix([src], 300, seed=3), seq_len=16, origins=True)
    real = p.origin >= 0
    assert (p.segments >= 0).tolist() == real.tolist()  # padding alone has no origin
    assert np.array_equal(p.tokens[real], stream[p.origin[real]])
    # a vector per stream position whose first entry is the position itself
    fw = FeatureWriter(tmp_path / "feat", dim=3, part_bytes=2 * 3 * 64)
    pos = torch.arange(len(stream), dtype=torch.float32)
    fw.add(torch.stack([pos, -pos, torch.ones_like(pos)], 1))
    feats = TokenFeatures(fw.close())
    p.save(tmp_path / "packed")
    loader = PackedLoader(type(p).load(tmp_path / "packed"), batch_size=3, features=feats)
    b = loader.next_batch()
    assert b["hidden"].shape == (3, 16, 3)
    rows = np.sort(loader.epoch_rows[:3])
    want = torch.from_numpy(p.origin[rows, :-1]).float()
    have = torch.where(want >= 0, b["hidden"][..., 0], -1.0)
    assert torch.equal(have, want)
    # where the token goes, its vector goes: inputs are row[:-1]
    assert torch.equal(b["tokens"][want >= 0],
                       torch.from_numpy(stream[want[want >= 0].long().numpy()]))


def test_origins_are_refused_where_they_would_mean_nothing(tmp_path):
    from codedojo.data.features import FeatureWriter, TokenFeatures

    for name in ("a", "b"):
        w = ShardWriter(tmp_path / name, 64, eos_id=None)
        w.add(np.arange(1, 20))
        w.close()
    two = [MixtureSource(name=n, path=str(tmp_path / n)) for n in ("a", "b")]
    with pytest.raises(ValueError, match="origins name places in one source"):
        pack(mix(two, 100), seq_len=8, origins=True)
    with pytest.raises(ValueError, match="origins need documents from a mixture"):
        pack([np.arange(5)], seq_len=8, origins=True)
    fw = FeatureWriter(tmp_path / "feat", dim=2)
    fw.add(torch.zeros(19, 2))
    with pytest.raises(ValueError, match="packed without origins"):
        PackedLoader(pack(mix(two[:1], 100), seq_len=8), batch_size=1,
                     features=TokenFeatures(fw.close()))


def test_a_document_that_spells_a_control_token_keeps_it_as_text(tmp_path):
    """A source file that mentions `<|im_end|>` (the end of a turn, and the documents' EOS)
    must not put that token inside the document: it is encoded as the text it is."""
    from codedojo.data.readers import Document
    from codedojo.data.shards import TokenShards
    from codedojo.model.tokenizer import load_tokenizer

    tok = load_tokenizer()
    text = 'END = "<|im_end|>"  # and <|endoftext|>, <filename>\n'
    tokenize_to_shards([Document(text, "a.py")], tok, tmp_path, tok.vocab_size, tok.eos_id)
    ids = TokenShards(tmp_path).doc(0).tolist()
    control = set(tok.special.control)
    assert ids[-1] == tok.eos_id and not control & set(ids[:-1])
    assert tok.decode(ids[:-1]) == text
    assert control & set(tok.encode(text))  # (as a chat template's text, they are the tokens)


def test_documents_that_lose_bytes_the_tokenizer_has_no_token_for_are_counted(tmp_path, byte_tok):
    """Their ids are the model's (the bytes are dropped, as HF's tokenizer drops them), and
    index.json counts them; a tokenizer that cannot say which bytes it lacks counts nothing."""
    from codedojo.model.tokenizer import load_tokenizer

    tok = load_tokenizer()
    docs = [Document(t, str(i)) for i, t in enumerate(
        ["x = 1\n", "ESC = '\x1b'\nSYN = '\x16'\n", "é 😀\n", "plane5 = '\U00050000'\n"])]
    tokenize_to_shards(docs, tok, tmp_path / "a", tok.vocab_size, tok.eos_id)
    sh = TokenShards(tmp_path / "a")
    assert sh.index["docs_with_dropped_bytes"] == 2
    assert tok.decode(sh.doc(1).tolist()[:-1]) == "ESC = '\x1b'\nSYN = ''\n"
    tokenize_to_shards(docs, byte_tok, tmp_path / "b", 257, 0)
    assert "docs_with_dropped_bytes" not in TokenShards(tmp_path / "b").index


def test_a_shard_directory_written_again_is_read_as_its_last_writer_left_it(tmp_path):
    """Written again without masks, a directory's old mask file is not read as the new one's;
    a writer that dies before close() leaves no index, not the old one over its shards."""
    from codedojo.data.shards import ShardWriter, TokenShards

    w = ShardWriter(tmp_path, 100, 0)
    w.add([1, 2, 3, 4], [0, 0, 1, 1])
    w.close()
    w = ShardWriter(tmp_path, 100, 0)
    w.add([5, 6, 7, 8])
    w.close()
    assert TokenShards(tmp_path).mask(0) is None  # no mask: every token trained
    w = ShardWriter(tmp_path, 100, 0, shard_tokens=4)
    w.add([7, 7, 7, 7, 7, 7])  # a shard file written, then the writer dies
    with pytest.raises(FileNotFoundError, match="no index.json"):
        TokenShards(tmp_path)


def test_a_shard_cut_short_is_refused_as_it_is_opened(tmp_path):
    w = ShardWriter(tmp_path / "s", vocab_size=100, eos_id=None)
    for _ in range(10):
        w.add(np.arange(50) % 100, np.ones(50))
    d = w.close()
    assert TokenShards(d).num_tokens == 500
    with open(d / "shard_00000.bin", "r+b") as f:
        f.truncate(40)
    with pytest.raises(ValueError, match=r"shard_00000.bin: does not match index.json: tokens "
                                         r"20 \(the index says 500\)"):
        TokenShards(d)


def test_a_mask_must_have_one_entry_per_token_and_max_rows_at_least_one():
    from codedojo.data.mixture import MixedDoc

    doc = MixedDoc(tokens=np.arange(10), mask=np.ones(1, np.uint8), source=0)
    with pytest.raises(ValueError, match="loss mask has 1 entries for its 10 tokens"):
        pack([doc], seq_len=4)
    with pytest.raises(ValueError, match="max_rows must be >= 1, got 0"):
        pack([np.arange(10)], seq_len=4, max_rows=0)


def test_a_weight_must_be_finite():
    with pytest.raises(ValueError, match="finite"):
        MixtureSource(name="a", path="x", weight=float("inf"))


def test_the_corpus_counts_the_documents_that_lost_bytes(tmp_path):
    from codedojo.data.corpus import CorpusConfig, CorpusStats, build_corpus
    from codedojo.model.tokenizer import load_tokenizer

    src = tmp_path / "src"
    src.mkdir()
    for i in range(40):
        body = "".join(f"def f{i}_{k}(x):\n    return x + {k}\n\n" for k in range(8))
        sep = "SEP = '\x1d'\n" if i % 10 == 0 else ""  # (a group separator: no SmolLM2 token)
        (src / f"m{i}.py").write_text(sep + body)
    tok = load_tokenizer()
    cfg = CorpusConfig.model_validate({"sources": [{"kind": "dir", "path": str(src)}],
                                       "holdout_frac": 0.2})
    _, _, stats, _ = build_corpus(cfg, tok, tmp_path / "out", tok.vocab_size, tok.eos_id)
    assert isinstance(stats, CorpusStats) and stats.train_docs + stats.eval_docs == 40
    assert stats.dropped_bytes_docs == 4
