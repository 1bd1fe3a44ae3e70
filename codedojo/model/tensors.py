"""A checkpoint's tensors taken out by name, each with the shape the config gives it: a tensor
one row too long beside one a row short would otherwise fuse, and split, at the wrong row."""

from __future__ import annotations

import torch


class Tensors:
    def __init__(self, tensors: dict[str, torch.Tensor], where: str) -> None:
        self.left, self.where = dict(tensors), where

    def take(self, name: str, *shape: int) -> torch.Tensor:
        """The tensor ``name``, which must be there with ``shape``; it is no longer left."""
        if name not in self.left:
            raise ValueError(f"{self.where}: tensor {name} is missing")
        t = self.left.pop(name)
        if tuple(t.shape) != shape:
            raise ValueError(f"{self.where}: {name} has shape {tuple(t.shape)}, the config "
                             f"gives {shape}")
        return t
