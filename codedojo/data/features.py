"""Per-token feature vectors beside a shard directory's tokens: one (D,) vector for each token,
in the order of the directory's token stream (its shards back to back, each document's tokens
in order). The MTP stage keeps the main model's last hidden states here, computed while the
model wrote the text, so that training does not run the frozen model over it again.

Layout of a feature directory::

    index.json             {"dim": D, "parts": [{"file", "tokens"}]}, the parts in stream order
    part_000_00000.f16     float16 (tokens, D), each row scaled by 2^-exp
    part_000_00000.exp.npy int8 (tokens,): the row's exponent

A row is stored as float16 after division by a power of two that brings its largest magnitude
under 2^15: float16's 11 significant bits whatever the row's scale, and no overflow (a model's
residual stream holds outliers in the thousands; float16 stops at 65504). Parts are appended in
order; ``close()`` writes index.json last, so a half-written directory is never read. Several
writers can fill one directory, each its own run of the stream (the ranks of a data-parallel
job, each with its ``name``): each calls ``finish()``, and one writes the index over all their
parts, in stream order (`write_index`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from codedojo.paths import write_atomic, write_synced

_HEADROOM = 15  # rows are scaled to a largest magnitude below 2^15


class FeatureWriter:
    """Appends (n, D) blocks of feature vectors, one row per token in token-stream order."""

    def __init__(self, out_dir: str | Path, dim: int, part_bytes: int = 1 << 28,
                 name: str = "part_000"):
        self.dir, self.dim, self.name = Path(out_dir), dim, name
        self.part_tokens = max(1, part_bytes // (2 * dim))  # rows held in memory until written
        self.dir.mkdir(parents=True, exist_ok=True)
        # the parts written, in order; a writer that goes on after another one stopped is
        # given that one's (the next part is numbered after them)
        self.parts: list[dict[str, object]] = []
        self._rows: list[np.ndarray] = []
        self._exps: list[np.ndarray] = []
        self._n = 0

    def add(self, x: torch.Tensor) -> None:
        """x (n, D), any float type."""
        if x.dim() != 2 or x.shape[1] != self.dim:
            raise ValueError(f"features: shape {tuple(x.shape)}, expected (n, {self.dim})")
        x = x.detach().float().cpu()
        if not bool(torch.isfinite(x).all()):
            raise ValueError("features: a row holds inf or nan")
        if x.shape[0] == 0:
            return  # (a part of no rows could not be read back: an empty file maps to nothing)
        peak = x.abs().amax(1).clamp_min(1e-30)
        exp = (torch.floor(torch.log2(peak)) + 1 - _HEADROOM).clamp(-127, 127).to(torch.int8)
        self._rows.append(torch.ldexp(x, -exp.float().unsqueeze(1)).half().numpy())
        self._exps.append(exp.numpy())
        self._n += x.shape[0]
        if self._n >= self.part_tokens:
            self.flush()

    def flush(self) -> None:
        """Write the rows held as a part (none held: nothing)."""
        if not self._rows:
            return
        name = f"{self.name}_{len(self.parts):05d}"
        rows, exps = np.concatenate(self._rows), np.concatenate(self._exps)
        write_synced(self.dir / f"{name}.f16", rows.tofile)
        write_synced(self.dir / f"{name}.exp.npy", lambda f: np.save(f, exps))
        self.parts.append({"file": f"{name}.f16", "tokens": int(rows.shape[0])})
        self._rows, self._exps, self._n = [], [], 0

    def finish(self) -> list[dict[str, object]]:
        """Write what is held; the parts written, for `write_index`."""
        self.flush()
        return self.parts

    def close(self) -> Path:
        """Finish, as the directory's one writer: its index lists this writer's parts."""
        return write_index(self.dir, self.dim, self.finish())


def write_index(out_dir: str | Path, dim: int, parts: list[dict[str, object]]) -> Path:
    """Make a directory of written parts readable: ``parts`` (`FeatureWriter.finish` of each
    writer, in stream order) become its index."""
    out = Path(out_dir)
    write_atomic(out / "index.json", json.dumps({"dim": dim, "parts": parts}, indent=1))
    return out


class TokenFeatures:
    """Read side: the vectors of any token positions, memory-mapped."""

    def __init__(self, path: str | Path):
        self.dir = Path(path)
        index_file = self.dir / "index.json"
        if not index_file.exists():
            raise FileNotFoundError(f"{self.dir}: no index.json (not a finished feature "
                                    "directory)")
        index = json.loads(index_file.read_text())
        self.dim = int(index["dim"])
        self._rows = [np.memmap(self.dir / p["file"], dtype=np.float16, mode="r",
                                shape=(int(p["tokens"]), self.dim)) for p in index["parts"]]
        self._exps = [np.load(self.dir / f"{str(p['file'])[:-len('.f16')]}.exp.npy",
                              mmap_mode="r") for p in index["parts"]]
        self._starts = np.concatenate([[0], np.cumsum([len(r) for r in self._rows])])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def gather(self, at: np.ndarray) -> torch.Tensor:
        """at (...) int token positions in the stream, -1 for none -> float32 (..., D), zeros
        where -1."""
        at = np.asarray(at, dtype=np.int64)
        flat = at.reshape(-1)
        if flat.size and (flat.max() >= len(self) or flat.min() < -1):
            raise IndexError(f"features: positions outside [0, {len(self)}) in {self.dir}")
        out = np.zeros((flat.size, self.dim), np.float32)
        exp = np.zeros(flat.size, np.float32)
        part = np.searchsorted(self._starts, flat, side="right") - 1
        for p in np.unique(part[flat >= 0]):
            sel = np.flatnonzero(part == p)
            local = flat[sel] - self._starts[p]
            out[sel] = self._rows[p][local]
            exp[sel] = self._exps[p][local]
        x = torch.ldexp(torch.from_numpy(out), torch.from_numpy(exp).unsqueeze(1))
        return x.view(*at.shape, self.dim)
