from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from codedojo.data.readers import SourceConfig
from codedojo.data.shards import ShardWriter, TokenShards
from codedojo.engine.reference import greedy_reference
from codedojo.model.config import ModelConfig
from codedojo.model.transformer import Transformer
from codedojo.pretrain.config import SelfGenConfig, StageConfig
from codedojo.pretrain.selfgen import (
    draw_windows,
    features_dir,
    greedy_continue,
    prompt_windows,
    write_features,
    write_self_shards,
)


@pytest.fixture()
def model() -> Transformer:
    torch.manual_seed(0)
    m = Transformer(ModelConfig.tiny(vocab_size=64, max_seq_len=64))
    with torch.no_grad():
        m.tok_embeddings.weight.mul_(20)  # peaked, varied continuations
    return m.train()


def _code(tmp_path, lengths) -> TokenShards:
    rng = np.random.default_rng(0)
    w = ShardWriter(tmp_path / "code", 64, eos_id=None)
    for n in lengths:
        w.add(rng.integers(1, 64, size=n))
    return TokenShards(w.close())


def test_batched_continuations_equal_one_at_a_time_greedy(model):
    prompts = torch.randint(1, 64, (3, 6))
    out = greedy_continue(model, prompts, 10)
    assert out.shape == (3, 16) and torch.equal(out[:, :6], prompts)
    for row, p in zip(out, prompts, strict=True):
        assert row[6:].tolist() == greedy_reference(model.eval(), p.tolist(), 10)
    assert len({tuple(r[6:].tolist()) for r in out}) > 1  # rows are not all alike


def _where(row: list[int], docs: list[list[int]]) -> set[tuple[int, int]]:
    return {(i, s) for i, d in enumerate(docs) for s in range(len(d) - len(row) + 1)
            if d[s:s + len(row)] == row}


def test_windows_are_distinct_slices_of_long_enough_documents(tmp_path):
    code = _code(tmp_path, [5, 30, 12, 40, 64])
    docs = [code.doc(i).tolist() for i in range(len(code))]
    w = prompt_windows(code, 9, 12, seed=0)
    spans = [_where(row, docs) for row in w.tolist()]
    assert all(len(s) == 1 for s in spans)  # random tokens: each window sits in one place
    assert [{(d, o)} for d, o in zip(*draw_windows(code, 9, 12, seed=0), strict=True)] == spans
    spans_ = sorted(next(iter(s)) for s in spans)
    assert {d for d, _ in spans_} <= {1, 2, 3, 4}  # never the 5-token document
    for (d0, s0), (d1, s1) in zip(spans_, spans_[1:], strict=False):
        assert d0 != d1 or s1 >= s0 + 12  # no two windows overlap
    # 4 documents of >= 12 tokens: 4 starts at most, one per document, however many are asked
    at_start = [s for d, s in spans_ if s == 0]
    assert 0 < len(at_start) <= 4
    all_starts = prompt_windows(code, 4, 12, seed=1, doc_start_frac=1.0)
    assert sorted(next(iter(_where(r, docs))) for r in all_starts.tolist()) == [
        (1, 0), (2, 0), (3, 0), (4, 0)]
    mid = prompt_windows(code, 6, 12, seed=0, doc_start_frac=0.0)
    assert all(s > 0 for r in mid.tolist() for _, s in _where(r, docs))
    # 4 starts and 1 + 2 + 4 later windows (lengths 30, 12, 40, 64): 11 in all, not 12
    assert len(prompt_windows(code, 11, 12, seed=2)) == 11
    with pytest.raises(ValueError, match="12 distinct windows of 12 tokens asked for, and the "
                       "code to draw from holds 11"):
        prompt_windows(code, 12, 12, seed=2)
    with pytest.raises(ValueError, match="no document to draw from has 65 tokens"):
        prompt_windows(code, 2, 65, seed=0)


def test_shards_are_written_once_and_the_model_is_left_training(tmp_path, model):
    code = _code(tmp_path, [30, 40, 25])
    out = tmp_path / "self"
    seen: list[int] = []
    write_self_shards(model, code, out, prompts=5, prompt_len=8, new_tokens=6, batch=2, seed=1,
                      progress=seen.append)
    assert seen == [2, 4, 5]
    shards = TokenShards(out)
    assert len(shards) == 5 and shards.doc_lengths().tolist() == [14] * 5
    assert model.training
    first = (out / "index.json").stat().st_mtime_ns
    write_self_shards(model, code, out, prompts=5, prompt_len=8, new_tokens=6, batch=2, seed=1)
    assert (out / "index.json").stat().st_mtime_ns == first


class _Stopped(Exception):
    pass


def stop_at(n: int, seen: list[int]) -> Callable[[int], None]:
    """A progress callback that notes the rows done and stops the pass once they reach n."""
    def progress(done: int) -> None:
        seen.append(done)
        if done == n:
            raise _Stopped
    return progress


def test_a_stopped_generation_goes_on_from_its_last_stretch_and_writes_the_same(tmp_path, model,
                                                                                 monkeypatch):
    """A generation stopped part-way (killed, preempted) and started again goes on from the
    last finished stretch of batches (here two batches of two rows), not from the first
    prompt, and writes the continuations and hidden states an unstopped run writes; a start
    with other settings begins again."""
    from codedojo.data.features import TokenFeatures
    from codedojo.pretrain import selfgen

    code = _code(tmp_path, [30, 40, 25])
    taps = (0,)
    batch_bytes = 2 * (1 + len(taps)) * model.cfg.dim * 14 * 2  # float16 states of 2 rows
    kw = dict(prompts=11, prompt_len=8, new_tokens=6, batch=2, seed=1, taps=taps,
              part_bytes=5 * batch_bytes // 2)  # stretches of 2 batches, each its own part
    calls: list[int] = []
    real = selfgen.greedy_continue
    monkeypatch.setattr(selfgen, "greedy_continue",
                        lambda m, x, *a, **k: calls.append(len(x)) or real(m, x, *a, **k))

    whole = write_self_shards(model, code, tmp_path / "whole", **kw)
    out = tmp_path / "self"
    seen: list[int] = []
    with pytest.raises(_Stopped):  # in the second stretch: the first (4 rows) is kept
        write_self_shards(model, code, out, **kw, progress=stop_at(6, seen))
    assert seen == [2, 4, 6] and not (out / "index.json").exists()
    calls.clear()
    seen.clear()
    resumed: list[int] = []
    write_self_shards(model, code, out, **kw, progress=seen.append, resumed=resumed.append)
    assert resumed == [4] and seen == [6, 8, 10, 11]  # from the 5th prompt on
    assert calls == [2, 2, 2, 1]
    assert not (out / "progress").exists()  # the log goes once the output is finished
    a, b = TokenShards(whole), TokenShards(out)
    assert [a.doc(i).tolist() for i in range(11)] == [b.doc(i).tolist() for i in range(11)]
    at = np.arange(11 * 14)
    assert torch.equal(TokenFeatures(features_dir(whole, taps)).gather(at),
                       TokenFeatures(features_dir(out, taps)).gather(at))

    again = tmp_path / "again"
    with pytest.raises(_Stopped):
        write_self_shards(model, code, again, **kw, progress=stop_at(8, []))
    seen.clear()
    resumed.clear()
    write_self_shards(model, code, again, **{**kw, "batch": 3}, progress=seen.append,
                      resumed=resumed.append)
    assert seen[0] == 3 and resumed == []  # another batch: from the start
    assert [TokenShards(again).doc(i).tolist() for i in range(11)] == [
        a.doc(i).tolist() for i in range(11)]


def test_a_stopped_pass_over_written_text_goes_on_and_writes_the_same(tmp_path, model):
    """The states of newly tapped layers for text already written (`write_features`), a pass
    stopped part-way: started again it goes on from its last logged stretch, and writes what an
    unstopped pass writes."""
    from codedojo.data.features import TokenFeatures

    code = _code(tmp_path, [30, 40, 25])
    out = write_self_shards(model, code, tmp_path / "self", prompts=7, prompt_len=8,
                            new_tokens=6, batch=2, seed=1)
    rows = TokenShards(out)
    dim = 2 * model.cfg.dim  # the last layer's states and layer 0's, in float16
    kw = dict(taps=(0,), batch=2, part_bytes=2 * 2 * 14 * dim * 2)  # 2 batches a part
    whole = write_features(model, rows, tmp_path / "whole", **kw)
    seen: list[int] = []
    with pytest.raises(_Stopped):  # in the second stretch: the first (4 rows) is kept
        write_features(model, rows, tmp_path / "feats", **kw,
                       progress=stop_at(6, seen))
    assert seen == [2, 4, 6] and (tmp_path / "feats" / "progress").exists()
    seen.clear()
    resumed: list[int] = []
    again = write_features(model, rows, tmp_path / "feats", **kw, progress=seen.append,
                           resumed=resumed.append)
    assert resumed == [4] and seen == [6, 7]
    assert not (again / "progress").exists()
    at = np.arange(7 * 14)
    assert torch.equal(TokenFeatures(whole).gather(at), TokenFeatures(again).gather(at))


def test_a_rank_that_got_further_goes_on_from_where_every_rank_was(tmp_path, monkeypatch):
    """Ranks stopped at once may have finished different numbers of stretches; they all go on
    from the last one every rank finished (they must make the same forward calls), the
    further rank writing its later stretches again."""
    from codedojo.pretrain import selfgen

    log = selfgen.ProgressLog(tmp_path, 0, {"batch": 2})
    first, second = np.arange(8).reshape(2, 4), np.arange(8, 16).reshape(2, 4)
    log.save(2, [{"file": "a", "tokens": 8}], first)
    log.save(4, [{"file": "a", "tokens": 8}, {"file": "b", "tokens": 8}], second)
    for others, start, parts, kept in [(4, 4, ["a", "b"], [first, second]),
                                       (2, 2, ["a"], [first]), (0, 0, [], [])]:
        monkeypatch.setattr(selfgen, "gather_object", lambda end, o=others: [end, o])
        again = selfgen.ProgressLog(tmp_path, 0, {"batch": 2})
        done, got, rows = again.resume()
        assert done == start and [p["file"] for p in got] == parts
        assert len(rows) == len(kept) and all(map(np.array_equal, rows, kept))
    monkeypatch.setattr(selfgen, "gather_object", lambda end: [end])
    assert selfgen.ProgressLog(tmp_path, 0, {"batch": 3}).resume() == (0, [], [])


def test_a_stretch_written_again_leaves_a_hard_link_to_the_old_one_as_it_was(tmp_path):
    """A branch's unfinished generation is hard-linked from its source run's: the stretches it
    writes again are new files, and the source's keep their rows."""
    import os

    from codedojo.pretrain import selfgen

    first, second = np.arange(8).reshape(2, 4), np.arange(8, 16).reshape(2, 4)
    selfgen.ProgressLog(tmp_path / "out", 0, {"batch": 2}).save(2, [], first)
    (tmp_path / "src").mkdir()
    (written,) = selfgen.progress_dir(tmp_path / "out").glob("rows_*.npy")
    os.link(written, tmp_path / "src" / written.name)
    selfgen.ProgressLog(tmp_path / "out", 0, {"batch": 3}).save(2, [], second)  # starts over
    assert np.array_equal(np.load(written), second)
    assert np.array_equal(np.load(tmp_path / "src" / written.name), first)


def test_a_self_mix_needs_self_gen():
    st = dict(name="s", seq_len=16, steps=1, mtp="distill")
    with pytest.raises(ValueError, match="`self` mix entry and `self_gen` go together"):
        StageConfig.model_validate({**st, "mix": [{"data": "self"}]})
    with pytest.raises(ValueError, match="`self` mix entry and `self_gen` go together"):
        StageConfig.model_validate({**st, "mix": [{"data": "code"}], "self_gen": {}})
    StageConfig.model_validate({**st, "mix": [{"data": "self"}],
                                "self_gen": {"prompts": 4, "prompt_len": 8, "new_tokens": 9}})


@pytest.mark.parametrize("taps", [(), (0,)])
@pytest.mark.parametrize("fuse", [True, False])
def test_the_hidden_states_of_the_generation_are_kept_for_training(tmp_path, model, fuse, taps):
    """Beside the shards go the model's last hidden states of every token (and the tapped
    layers' the MTP modules read), as its forward over the whole text gives them; a
    distillation loss on them is the one the forward gives. Text written without the taps has
    their states computed from it (`write_features`), as the generation would keep them."""
    from codedojo.data.features import TokenFeatures
    from codedojo.data.mixture import MixtureSource, mix
    from codedojo.data.packing import PackedLoader, pack
    from codedojo.model.mtp import MTP
    from codedojo.pretrain.trainer import stage_loss

    model.fuse = fuse  # the CPU kernels' pass and the op-by-op one
    code = _code(tmp_path, [30, 40, 25])
    out = tmp_path / "self"
    write_self_shards(model, code, out, prompts=5, prompt_len=8, new_tokens=6, batch=2, seed=1,
                      taps=taps)
    shards, feats = TokenShards(out), TokenFeatures(features_dir(out, taps))
    assert len(feats) == shards.num_tokens == 5 * 14
    assert feats.dim == (1 + len(taps)) * model.cfg.dim
    seen: list[int] = []
    later = write_features(model, shards, features_dir(out, (1,)), (1,), batch=2,
                           progress=seen.append)
    assert later.name == "hidden-taps-1" and seen == [2, 4, 5] and model.training
    computed = TokenFeatures(later).gather(np.arange(70).reshape(5, 14))
    model.eval()
    rows = torch.from_numpy(np.stack([shards.doc(i) for i in range(5)]))
    with torch.no_grad():
        full, with_1 = model.hidden(rows, taps=taps), model.hidden(rows, taps=(1,))
    stored = feats.gather(np.arange(70).reshape(5, 14))
    # float16 keeps 11 significant bits of each row's largest entry (`features.py`)
    for got, want in ((stored, full), (computed, with_1)):
        err = (got - want).abs() / want.abs().amax(-1, keepdim=True)
        assert float(err.max()) <= 2**-11 * 1.01
    # packed rows with origins, of 14 (a document each) and of 21 (documents kept whole, the
    # rest padding): the loss from the stored states
    torch.manual_seed(1)
    mtp = MTP(model.cfg, depth=2, taps=taps)
    with torch.no_grad():
        for layer in mtp.layers:  # the tapped states read
            if layer.fuse is not None:
                layer.fuse.weight.normal_(std=0.5)
    starts = {shards.doc_start(i) for i in range(5)}
    for seq_len in (13, 20):
        p = pack(mix([MixtureSource(name="self", path=str(out), whole=True)], 70, seed=0),
                 seq_len=seq_len, origins=True)
        first = np.ones_like(p.segments, dtype=bool)  # each piece of a row starts a document
        first[:, 1:] = p.segments[:, 1:] != p.segments[:, :-1]
        assert set(p.origin[first & (p.origin >= 0)].tolist()) <= starts
        batch = PackedLoader(p, batch_size=4, features=feats).next_batch()
        stored_loss, _ = stage_loss(model, mtp, batch, "distill", 1.0)
        batch.pop("hidden")
        run_loss, _ = stage_loss(model, mtp, batch, "distill", 1.0)
        torch.testing.assert_close(stored_loss, run_loss, rtol=2e-3, atol=0)


@pytest.mark.parametrize("where", ["model", "stage"])
def test_a_bf16_run_generates_its_continuations_under_autocast(tmp_path, monkeypatch, where):
    """`dtype = "bf16"` (the run's, or the stage's alone): the model writes its continuations,
    and the hidden states kept beside them, computing as the stage trains (under autocast), not
    in float32."""
    from rich.console import Console

    from codedojo.data.features import TokenFeatures
    from codedojo.model.tokenizer import load_tokenizer
    from codedojo.model.weights import load_model
    from codedojo.pretrain.trainer import run
    from tests.pretrain.tiny_run import five_stage_config

    # op by op, as on a GPU: the CPU kernels' passes compute in the weights' dtype
    monkeypatch.setattr(Transformer, "fuse", False)
    if where == "model":
        cfg = five_stage_config(tmp_path, "b", dtype="bf16")
    else:  # float32 up to the last stage, which alone runs in bf16
        cfg = five_stage_config(tmp_path, "b")
        cfg.stages[-1].dtype = "bf16"
    run(cfg, tok=load_tokenizer(), console=Console(quiet=True))
    (out,) = (cfg.run_dir / "data" / "self").iterdir()
    shards, feats = TokenShards(out), TokenFeatures(out / "hidden")
    g = cfg.stages[-1].self_gen
    docs = torch.from_numpy(np.stack([shards.doc(i) for i in range(len(shards))]))
    stored = feats.gather(np.arange(docs.numel()).reshape(docs.shape))
    model, _ = load_model(cfg.run_dir / "ckpt" / "sft")  # the model that generated them

    def generate(autocast: bool) -> tuple[torch.Tensor, torch.Tensor]:
        rows, hidden = [], []
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            for i in range(0, len(docs), g.batch):  # in the run's batches
                h: list[torch.Tensor] = []
                rows.append(greedy_continue(model, docs[i:i + g.batch, :g.prompt_len],
                                            g.new_tokens, h))
                hidden.append(torch.cat(h, 1).float())
        return torch.cat(rows), torch.cat(hidden)

    def err(h: torch.Tensor) -> float:  # relative to each row's largest entry, as stored
        return float(((stored - h).abs() / h.abs().amax(-1, keepdim=True)).max())

    tokens, bf16 = generate(autocast=True)
    assert torch.equal(tokens, docs)
    assert err(bf16) <= 2**-11 * 1.01  # float16 storage
    assert err(generate(autocast=False)[1]) > 2**-11 * 2  # a float32 generation is told apart


def _sources(tmp_path, corpus) -> tuple[list[str], Path]:
    """A source folder holding a copy of every corpus file, two files of new code and one of
    them again: the new code, as the pool should take it."""
    import shutil

    src = tmp_path / "more"
    shutil.copytree(corpus, src)
    new = [f"class Zebra{i}:\n" + "".join(f"    def stripe{j}(self):\n        return {i} ** {j}\n"
                                          for j in range(30)) for i in range(2)]
    for i, text in enumerate(new):
        (src / f"zebra{i}.py").write_text(text)
    (src / "zebra_again.py").write_text(new[0])
    return new, src


def test_prompts_are_drawn_from_the_sources_too_without_corpus_files(tmp_path):
    """`self_gen.sources`: the pool is the training code, then the sources' new files, once
    each; a copy of a corpus file, training or held out, is not drawn from again."""
    from codedojo.model.tokenizer import load_tokenizer
    from codedojo.pretrain.trainer import prepare_data
    from tests.pretrain.tiny_run import five_stage_config

    cfg = five_stage_config(tmp_path, "p")
    new, src = _sources(tmp_path, tmp_path / "src")
    cfg.stages[-1].self_gen.sources = [SourceConfig(kind="dir", path=str(src))]
    tok = load_tokenizer()
    data = prepare_data(cfg, tok, cfg.run_dir)
    pool, train = TokenShards(data.prompts["mtp_self"]), TokenShards(data.shards["code"])
    held = TokenShards(cfg.run_dir / "data" / "eval")
    assert len(held) > 0
    docs = [pool.doc(i).tolist() for i in range(len(pool))]
    assert docs == [train.doc(i).tolist() for i in range(len(train))] + [
        tok.encode(t) + [tok.eos_id] for t in new]
    assert prepare_data(cfg, tok, cfg.run_dir).prompts == data.prompts  # found again
    cfg.stages[-1].self_gen.sources = []
    assert prepare_data(cfg, tok, cfg.run_dir).prompts == {}
    # sources with nothing new in them are a mistake, named
    cfg.stages[-1].self_gen.sources = [SourceConfig(kind="dir", path=str(tmp_path / "src"))]
    with pytest.raises(ValueError, match="self_gen.sources hold no file"):
        prepare_data(cfg, tok, cfg.run_dir)


def test_a_run_continues_prompts_from_its_sources(tmp_path):
    from rich.console import Console

    from codedojo.model.tokenizer import load_tokenizer
    from codedojo.pretrain.trainer import run
    from tests.pretrain.tiny_run import five_stage_config

    tok = load_tokenizer()
    cfg = five_stage_config(tmp_path, "s")
    new, src = _sources(tmp_path, tmp_path / "src")
    g = cfg.stages[-1].self_gen
    g.sources = [SourceConfig(kind="dir", path=str(src))]
    g.prompts, g.batch = 32, 16  # of about 800 windows, 120 the new code's
    run(cfg, tok=tok, console=Console(quiet=True))
    (out,) = (cfg.run_dir / "data" / "self").iterdir()
    shards = TokenShards(out)
    train = TokenShards(cfg.run_dir / "data" / "train")
    zebra = {t for text in new for t in tok.encode(text)} - {
        t for i in range(len(train)) for t in train.doc(i).tolist()}
    prompts = [shards.doc(i)[:g.prompt_len].tolist() for i in range(len(shards))]
    assert any(zebra & set(p) for p in prompts)  # some prompts are the new code's
    assert not all(zebra & set(p) for p in prompts)  # and some the training code's


def test_fields_at_their_first_defaults_dump_as_before_they_existed():
    """The continuations and packed rows are cached under a hash of these settings: a config
    naming no sources, and keeping the prompt's loss, keeps the key it had."""
    g = SelfGenConfig(prompts=8)
    for field in ("sources", "prompt_loss"):
        assert field not in g.model_dump() and field not in g.model_dump_json()
    h = SelfGenConfig(prompts=8, sources=[SourceConfig(kind="dir", path="stdlib")],
                      prompt_loss=False)
    assert h.model_dump()["sources"][0]["path"] == "stdlib"
    assert h.model_dump()["prompt_loss"] is False
    assert SelfGenConfig.model_validate_json(h.model_dump_json()) == h


def test_a_run_s_data_is_used_only_with_the_tokenizer_that_made_it(tmp_path):
    """Another tokenizer (a fixed split, another model) gives other ids for the same text: a
    run's data made by one is refused to another, rather than trained on as if its own."""
    import json

    from codedojo.model.tokenizer import load_tokenizer
    from codedojo.pretrain.trainer import prepare_data
    from tests.pretrain.tiny_run import five_stage_config

    cfg = five_stage_config(tmp_path, "t")
    tok = load_tokenizer()
    prepare_data(cfg, tok, cfg.run_dir)
    done = cfg.run_dir / "data" / "done.json"
    assert json.loads(done.read_text())["tokenizer"] == tok.fingerprint
    prepare_data(cfg, tok, cfg.run_dir)  # the same: found again
    for was in ("0" * 16, None):  # another's, or none recorded (made before they were)
        done.write_text(json.dumps({**json.loads(done.read_text()), "tokenizer": was}))
        with pytest.raises(ValueError, match="tokenized by another tokenizer"):
            prepare_data(cfg, tok, cfg.run_dir)
