"""Self-generated data for MTP distillation: what the model writes itself.

At inference the MTP modules draft continuations of the model's own output, not of human code.
Distilling them on the model's own greedy continuations (Medusa-2's self-distillation) trains
them on the text they will draft. Prompts are windows of the training code (and of the stage's
``self_gen.sources``); the continuations come from the model as it is when the stage starts,
batched over a KV cache, and are written as token shards (prompt + continuation, one document
each) that the stage's mixture reads as ``data = "self"``. Beside them (``hidden/``,
``codedojo.data.features``) go the model's last hidden states of every token, which the
generation computes anyway: the stage trains the modules on them instead of running the frozen
model over the text again, two thirds of a distillation step's time (measured by
``benchmarks/mtp_distill_step.py``). Modules that read lower layers' states too
(``model.mtp_taps``) have them kept after the last ones, in a directory named by the layers
(`features_dir`); for text generated without them (a branch that gives the modules taps),
`write_features` computes them in one forward pass over the rows, far cheaper than generating
the text again.

The generation loop is written here rather than taken from ``codedojo.engine.Engine``: every
row has the same length and no stop, so it needs no scheduler, and the engine takes the model
over for serving (it switches it to eval mode for good and, without the CPU kernels, restrides
its weights in place), which a model in the middle of training must not undergo.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from codedojo.data.features import FeatureWriter, write_index
from codedojo.data.shards import ShardWriter, TokenShards
from codedojo.model.kv_cache import KVCache
from codedojo.model.transformer import Transformer
from codedojo.paths import write_atomic
from codedojo.pretrain.parallel import gather_object, gather_root, model_device


@torch.no_grad()
def greedy_continue(model: Transformer, prompts: torch.Tensor, new_tokens: int,
                    hidden: list[torch.Tensor] | None = None, taps: Sequence[int] = ()
                    ) -> torch.Tensor:
    """prompts (B, P) -> (B, P + new_tokens): each row continued greedily, all rows at once.
    ``hidden``: a list that receives the last hidden states of all those tokens, (B, P +
    new_tokens, D) in pieces along the sequence (the last token takes one more step); with
    ``taps``, those layers' states after them (`Transformer.hidden`)."""
    was = model.training
    model.eval()
    B, P = prompts.shape
    gather_root(model)  # under FSDP: the cache takes the dtype of the weights computed with
    w = model.tok_embeddings.weight
    cache = KVCache(model.cfg, B, P + new_tokens, dtype=w.dtype, device=w.device,
                    initial_len=P + new_tokens)
    out = [prompts]
    view = cache.view(0, B)
    logits, h = model(prompts, cache=view, last_only=True, return_hidden=True,
                      taps=taps)  # (B, 1, V)
    for i in range(new_tokens):
        if hidden is not None:
            hidden.append(h)
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out.append(nxt)
        if i + 1 < new_tokens:
            logits, h = model(nxt, cache=view, return_hidden=True, taps=taps)
        elif hidden is not None:
            hidden.append(model.hidden(nxt, cache=view, taps=taps))
    model.train(was)
    return torch.cat(out, 1)


def prompt_windows(code: TokenShards, n: int, length: int, seed: int,
                   doc_start_frac: float = 0.5) -> np.ndarray:
    """n distinct, non-overlapping windows of `length` tokens from documents at least that long:
    up to a share `doc_start_frac` at the start of a document (writing a file from its top), one
    per document, the rest drawn from the other windows of a tiling of every document (at a
    random phase each), continuing one mid-way. A window seen twice teaches the drafts one
    continuation twice, so a corpus without n windows is refused, naming how many it holds.
    Where each is cut from: `draw_windows`."""
    docs, offs = draw_windows(code, n, length, seed, doc_start_frac)
    out = np.empty((n, length), np.int64)
    for i, (d, s) in enumerate(zip(docs.tolist(), offs.tolist(), strict=True)):
        out[i] = code.doc(d)[s:s + length]
    return out


def draw_windows(code: TokenShards, n: int, length: int, seed: int,
                 doc_start_frac: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """(the document, the offset in it) of each of `prompt_windows`' windows, in its order."""
    lens = code.doc_lengths()
    ok = np.flatnonzero(lens >= length)
    if len(ok) == 0:
        raise ValueError(f"no document to draw from has {length} tokens")
    rng = np.random.default_rng(seed)
    n_starts = min(round(n * doc_start_frac), len(ok))
    starts = rng.choice(ok, size=n_starts, replace=False)
    # The rest of each document is cut into windows after its first `length` tokens, from a
    # random phase (so the cuts differ between documents); the windows are counted, not listed,
    # so that a corpus of billions of tokens costs nothing to draw from.
    phase = rng.integers(0, lens[ok] % length + 1)
    per_doc = np.maximum(0, (lens[ok] - 2 * length - phase) // length + 1)
    n_mid = min(n - n_starts, int(per_doc.sum()))
    idx = rng.choice(int(per_doc.sum()), size=n_mid, replace=False)
    first = np.cumsum(per_doc) - per_doc  # index of each document's first window
    at = np.searchsorted(first, idx, side="right") - 1
    docs = np.concatenate([starts, ok[at]])
    offs = np.concatenate([np.zeros(n_starts, np.int64),
                           length + phase[at] + (idx - first[at]) * length])
    # Short of windows, the starts of the documents not drawn yet come last.
    unused = np.setdiff1d(ok, starts)
    more = min(n - len(docs), len(unused))
    docs = np.concatenate([docs, rng.choice(unused, size=more, replace=False)])
    offs = np.concatenate([offs, np.zeros(more, np.int64)])
    if len(docs) < n:
        raise ValueError(f"{n} distinct windows of {length} tokens asked for, and the code "
                         f"to draw from holds {len(docs)}")
    order = rng.permutation(n)  # batches mix starts and middles
    return docs[order], offs[order]


def features_dir(self_dir: Path, taps: Sequence[int] = ()) -> Path:
    """Where the hidden states kept beside self-generated shards are: ``hidden`` (the last
    layer's), or ``hidden-taps-8-20`` (with the states of layers 8 and 20 after them)."""
    return self_dir / ("hidden-taps-" + "-".join(map(str, taps)) if taps else "hidden")


@torch.no_grad()
def write_features(model: Transformer, rows: TokenShards, out: Path, taps: Sequence[int],
                   batch: int, rank: int = 0, world: int = 1,
                   progress: Callable[[int], None] | None = None,
                   resumed: Callable[[int], None] | None = None, part_bytes: int = 1 << 28
                   ) -> Path:
    """The hidden states of every token of ``rows`` (documents of one length, as
    `write_self_shards` writes them) with those of ``taps`` after them, by a forward pass over
    them, into the feature directory ``out`` (skipped when it is finished); ``progress(n)``
    after each batch. Data parallel as `write_self_shards`: each rank its share, rank 0 the
    index. Resumable as it is: a pass stopped part-way goes on from the last stretch of
    batches every rank logged (``resumed(n)`` first)."""
    if (out / "index.json").exists():
        return out
    lens = rows.doc_lengths()
    if len(set(lens.tolist())) != 1:
        raise ValueError(f"{rows.dir}: documents of several lengths; self-generated rows "
                         "(prompt and continuation, one length) expected")
    n = len(lens)
    share = -(-n // world)
    was = model.training
    model.eval()
    gather_root(model)
    dev = model_device(model)
    writer = FeatureWriter(out, (1 + len(taps)) * model.cfg.dim, part_bytes,
                           name=f"part_{rank:03d}")
    every = max(1, writer.part_tokens // (int(lens[0]) * batch))  # batches a stretch
    log = ProgressLog(out, rank, {"rows": n, "world": world, "batch": batch, "every": every,
                                  "taps": list(taps)})
    done, writer.parts, _ = log.resume()
    if done and resumed is not None:
        resumed(min(done * world, n))
    for i in range(done, share, batch):  # every rank the same calls (the padding: row 0)
        at = [rank * share + j for j in range(i, min(i + batch, share))]
        x = torch.from_numpy(np.stack([rows.doc(j if j < n else 0) for j in at]).astype(np.int64))
        h = model.hidden(x.to(dev), taps=taps)
        keep = sum(j < n for j in at)
        if keep:
            writer.add(h[:keep].flatten(0, 1))
        end = i + len(at)
        if (i // batch + 1) % every == 0 or end == share:
            writer.flush()
            log.save(end, writer.parts)
        if progress is not None:
            progress(min(end * world, n))
    model.train(was)
    parts = gather_object(writer.finish())
    if rank == 0:
        write_index(out, writer.dim, [p for ps in parts for p in ps])
        log.clear()
    return out


def continue_windows(model: Transformer, code: TokenShards, n: int, prompt_len: int,
                     new_tokens: int, seed: int, batch: int = 32) -> torch.Tensor:
    """(n, prompt_len + new_tokens) on the CPU: n distinct windows of ``code`` (`prompt_windows`,
    half at a file's start), each continued greedily by ``model``, ``batch`` rows at a time."""
    windows = torch.from_numpy(prompt_windows(code, n, prompt_len, seed))
    dev = model_device(model)
    with torch.no_grad():
        return torch.cat([greedy_continue(model, windows[i:i + batch].to(dev), new_tokens).cpu()
                          for i in range(0, n, batch)])


def write_self_shards(model: Transformer, code: TokenShards, out_dir: Path, *, prompts: int,
                      prompt_len: int, new_tokens: int, batch: int, seed: int,
                      doc_start_frac: float = 0.5, rank: int = 0, world: int = 1,
                      taps: Sequence[int] = (), progress: Callable[[int], None] | None = None,
                      resumed: Callable[[int], None] | None = None, part_bytes: int = 1 << 28
                      ) -> Path:
    """Generate and write the shards (skipped when `out_dir` is already finished);
    ``progress(n)`` after each batch, n about the continuations made so far (``resumed(n)``
    first, when it goes on from a stopped run's n); ``taps``: the hidden states kept carry
    those layers' after the last (in `features_dir`).

    Data parallel (``world`` ranks, every one calling): each rank continues its own share of
    the prompts, and rank 0 gathers them all and writes them in prompt order. The shares are
    padded to one length, so that every rank makes the same forward calls, as the collectives
    of a sharded model need. Each rank writes the hidden states of its own share into
    ``hidden/`` itself (the run directory is shared, as it is for the shards), and rank 0
    indexes them in the same order once all have.

    Resumable: the batches go in stretches of about ``part_bytes`` of hidden states. After
    each, the stretch's states are written as a part and its continuations beside them
    (`ProgressLog`), so a run stopped part-way (killed, preempted) and started again goes
    on from the last stretch every rank finished, in the same batches: what it writes is what
    an unstopped run writes."""
    if (out_dir / "index.json").exists():
        return out_dir
    try:
        windows = prompt_windows(code, prompts, prompt_len, seed, doc_start_frac)
    except ValueError as e:
        raise ValueError(f"self_gen.prompts, self_gen.prompt_len: {e}; ask for fewer or "
                         "shorter, or add code to the corpus or to self_gen.sources") from e
    share = -(-prompts // world)
    mine = windows[rank * share:(rank + 1) * share]
    own = len(mine)
    mine = np.concatenate([mine, np.repeat(windows[:1], share - own, axis=0)])  # the padding
    dev = model_device(model)
    dim = (1 + len(taps)) * model.cfg.dim
    row_len = prompt_len + new_tokens
    feats = FeatureWriter(features_dir(out_dir, taps), dim, part_bytes, name=f"part_{rank:03d}")
    every = max(1, feats.part_tokens // (row_len * batch))  # batches a stretch: a part's worth
    log = ProgressLog(out_dir, rank, {
        "prompts": prompts, "prompt_len": prompt_len, "new_tokens": new_tokens, "seed": seed,
        "doc_start_frac": doc_start_frac, "world": world, "batch": batch, "every": every,
        "taps": list(taps)})
    done, feats.parts, rows = log.resume()  # the writer goes on after the parts logged
    if done and resumed is not None:
        resumed(min(done * world, prompts))
    stretch: list[np.ndarray] = []
    for i in range(done, share, batch):
        x = torch.from_numpy(mine[i:i + batch]).to(dev)
        h: list[torch.Tensor] = []
        out = greedy_continue(model, x, new_tokens, h, taps)
        keep = min(len(x), own - i)  # the rest are padding, not written
        if keep > 0:
            feats.add(torch.cat(h, 1)[:keep].flatten(0, 1))  # row by row: the shards' order
            stretch.append(out[:keep].cpu().numpy())
        end = i + len(x)
        if (i // batch + 1) % every == 0 or end == share:
            feats.flush()
            rows.append(np.concatenate(stretch) if stretch
                        else np.empty((0, row_len), np.int64))
            log.save(end, feats.parts, rows[-1])
            stretch = []
        if progress is not None:
            progress(min(end * world, prompts))
    shares = gather_object(np.concatenate(rows))
    parts = gather_object(feats.finish())
    if rank != 0:
        return out_dir
    # before the shards' index: a finished directory has both
    write_index(feats.dir, feats.dim, [p for ps in parts for p in ps])
    writer = ShardWriter(out_dir, model.cfg.vocab_size, eos_id=None)
    for r in np.concatenate(shares):
        writer.add(r)
    writer.close()
    log.clear()
    return out_dir


def progress_dir(out_dir: Path) -> Path:
    """Where a resumable pass into ``out_dir`` logs how far it has come (`ProgressLog`)."""
    return out_dir / "progress"


class ProgressLog:
    """How far one rank's pass over its share of rows has come, beside its output
    (``progress/``): the feature parts it has written, and for each finished stretch of
    batches where it ended in the rank's share and how many of those parts it filled; a
    generation's stretches keep their continuations too (``rows_<rank>_<k>.npy``). The
    settings it was made with go with it; a log made with others (another number of ranks,
    another batch) is not resumed from."""

    def __init__(self, out_dir: Path, rank: int, settings: dict[str, object]):
        self.dir, self.rank, self.settings = progress_dir(out_dir), rank, settings
        self.file = self.dir / f"rank_{rank:03d}.json"
        self.stretches: list[dict[str, int]] = []

    def _rows_file(self, k: int) -> Path:
        return self.dir / f"rows_{self.rank:03d}_{k:05d}.npy"

    def resume(self) -> tuple[int, list[dict[str, Any]], list[np.ndarray]]:
        """Where to go on from: the row of the rank's share, its feature parts up to there and
        the rows its stretches kept. Every rank calls it: they go on from the last stretch all
        of them finished (they make the same forward calls), so a rank that got further writes
        its later stretches again."""
        saved = json.loads(self.file.read_text()) if self.file.exists() else {}
        mine = saved.get("stretches", []) if saved.get("settings") == self.settings else []
        ends: list[Any] = gather_object(mine[-1]["end"] if mine else 0)
        start = min(ends)
        self.stretches = [s for s in mine if s["end"] <= start]
        if not self.stretches:
            return 0, [], []
        rows = [np.load(self._rows_file(k)) for k, s in enumerate(self.stretches)
                if s.get("rows", True)]  # (a generation's log before the key was written)
        return start, saved["parts"][:self.stretches[-1]["parts"]], rows

    def save(self, end: int, parts: list[dict[str, Any]], rows: np.ndarray | None = None
             ) -> None:
        """A stretch is finished, up to row ``end`` of the rank's share: with it the feature
        parts on disk, ``parts``, and the rows it made to keep, if any."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if rows is not None:  # a new file: a branch's may be a hard link to its source's
            write_atomic(self._rows_file(len(self.stretches)), lambda f: np.save(f, rows))
        self.stretches.append({"end": end, "parts": len(parts), "rows": rows is not None})
        write_atomic(self.file, json.dumps({"settings": self.settings, "parts": parts,
                                            "stretches": self.stretches}))

    def clear(self) -> None:
        """The output is finished: the log of every rank goes."""
        shutil.rmtree(self.dir, ignore_errors=True)
