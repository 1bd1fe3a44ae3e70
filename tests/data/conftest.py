from __future__ import annotations

import pytest


class ByteTokenizer:
    """Bytes + 1 (0 is EOS): enough to exercise the data path without a real vocabulary."""

    vocab_size = 257
    eos_id = 0

    def encode(self, text: str, special: bool = True) -> list[int]:
        return [b + 1 for b in text.encode()]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - 1 for i in ids if i > 0).decode(errors="replace")


@pytest.fixture
def byte_tok() -> ByteTokenizer:
    return ByteTokenizer()
