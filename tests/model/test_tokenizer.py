"""The GGUF tokenizer: header reading, BPE from vocab + merges, special tokens, incremental decoding."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import decoders

from codedojo.model.tokenizer import (
    CHATML_TEMPLATE,
    GGUFMetadataError,
    Tokenizer,
    byte_alphabet,
    load_tokenizer,
    read_gguf_kv,
    tiny_tokenizer,
)

TEXTS = [
    "def add(a, b):\n    return a + b  # sum\n\n\n",
    "héllo wörld 你好世界 🎉🎉 \t\t tabs\r\n",
    "  leading spaces and 12345.678e-9 'quoted' it's DON'T",
    "emoji with joiner 👩\u200d💻 and \u00a0nbsp \x00\x01 controls",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
]


def write_gguf(path: Path, tokens: list[str], merges: list[str], types: list[int], model: str = "gpt2",
               pre: str | None = None) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(CHATML_TEMPLATE)
    w.add_uint32("llama.context_length", 64)
    w.add_tensor("t", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture()
def tiny_gguf(tmp_path) -> Path:
    table = byte_alphabet()
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [table[b] for b in range(256)] + ["he", "Ġhe"]
    types = [3, 3, 3] + [1] * 258
    return write_gguf(tmp_path / "tiny.gguf", tokens, ["h e", "Ġ he"], types)


def test_header_reader_reads_metadata_only(tiny_gguf):
    meta = read_gguf_kv(tiny_gguf)
    assert meta["general.architecture"] == "llama" and meta["llama.context_length"] == 64
    assert meta["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert meta["tokenizer.ggml.merges"] == ["h e", "Ġ he"] and meta["tokenizer.ggml.token_type"][:4] == [3, 3, 3, 1]
    assert set(read_gguf_kv(tiny_gguf, prefix="tokenizer.")) == {k for k in meta if k.startswith("tokenizer.")}


def test_from_gguf_builds_bpe_with_specials(tiny_gguf):
    tok = Tokenizer.from_gguf(tiny_gguf)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 2, 2, 261)
    assert tok.encode(" he") == [260] and tok.encode("he") == [259]
    assert tok.encode("<|im_start|>he<|im_end|>") == [1, 259, 2]
    assert tok.chat_template == CHATML_TEMPLATE and tok.stop_token_ids() == [2, 0]
    for s in TEXTS:
        assert tok.decode(tok.encode(s)) == s


def test_bad_files_are_named(tmp_path, tiny_gguf):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 32)
    with pytest.raises(GGUFMetadataError, match="not a GGUF"):
        read_gguf_kv(bad)
    table = byte_alphabet()
    spm = write_gguf(tmp_path / "spm.gguf", [table[b] for b in range(256)], [], [1] * 256, model="llama")
    with pytest.raises(ValueError, match="tokenizer.ggml.model is 'llama'"):
        Tokenizer.from_gguf(spm)


def test_a_cut_or_corrupt_header_is_named_with_its_byte(tmp_path, tiny_gguf):
    import struct

    data = tiny_gguf.read_bytes()
    meta = read_gguf_kv(tiny_gguf)
    cut = tmp_path / "cut.gguf"
    for n in [0, 3, 23, 24, 30, *range(40, len(data), max(1, len(data) // 97))]:
        cut.write_bytes(data[:n])
        try:
            assert read_gguf_kv(cut) == meta  # (cut after the header: all of it is there)
        except GGUFMetadataError as e:
            assert str(cut) in str(e) and ("past the end" in str(e) or "not a GGUF" in str(e))
    at = data.index(b"tokenizer.ggml.tokens") + len("tokenizer.ggml.tokens") + 8
    huge = data[:at] + struct.pack("<Q", 1 << 40) + data[at + 8:]
    cut.write_bytes(huge)
    with pytest.raises(GGUFMetadataError, match=r"an array of 1099511627776 items at byte"):
        read_gguf_kv(cut)


def test_save_and_load_dir_round_trip(tmp_path):
    tok = tiny_tokenizer()
    tok.save(tmp_path / "tk")
    back = Tokenizer.from_dir(tmp_path / "tk")
    assert (back.bos_id, back.eos_id, back.pad_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    assert back.chat_template == tok.chat_template and sorted(back.special.control) == [0, 1, 2]
    for s in TEXTS:
        assert back.encode(s) == tok.encode(s)
    assert load_tokenizer(str(tmp_path / "tk")).encode("the") == tok.encode("the")


def test_a_template_saved_on_its_own_is_read(tmp_path):
    """transformers now writes the chat template to chat_template.jinja, not the config."""
    import json

    tiny_tokenizer().save(tmp_path / "tk")
    cfg_path = tmp_path / "tk" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    (tmp_path / "tk" / "chat_template.jinja").write_text(cfg.pop("chat_template"))
    cfg_path.write_text(json.dumps(cfg))
    assert Tokenizer.from_dir(tmp_path / "tk").chat_template == CHATML_TEMPLATE


def test_a_folder_named_as_the_builtin_model_is_that_folder(tmp_path, monkeypatch):
    """A download or a fine-tune saved as `SmolLM2-135M-Instruct`: its weights and its
    tokenizer, not the shipped model's weights with the folder's tokenizer."""
    import torch

    from codedojo.model.config import ModelConfig
    from codedojo.model.hf import save_hf
    from codedojo.model.transformer import Transformer
    from codedojo.model.weights import read_weights

    tok = tiny_tokenizer()
    cfg = ModelConfig.tiny(vocab_size=tok.vocab_size)
    torch.manual_seed(0)
    folder = tmp_path / "SmolLM2-135M-Instruct"
    save_hf(Transformer(cfg), cfg, folder)
    tok.save(folder)
    monkeypatch.chdir(tmp_path)
    load_tokenizer.cache_clear()
    try:
        assert load_tokenizer("SmolLM2-135M-Instruct").vocab_size == tok.vocab_size
        _, read = read_weights("SmolLM2-135M-Instruct")
        assert (read.dim, read.vocab_size) == (cfg.dim, cfg.vocab_size)
    finally:
        load_tokenizer.cache_clear()


def test_incremental_decoder_never_splits_characters():
    tok = tiny_tokenizer()  # bytes only, so every non-ASCII character spans several tokens
    for s in TEXTS:
        ids = tok.encode(s)
        dec = tok.incremental_decoder(skip_special_tokens=False)
        pieces = [dec.push(i) for i in ids] + [dec.flush()]
        assert "".join(pieces) == s
        assert not any("\ufffd" in p for p in pieces)


def test_incremental_decoder_skips_specials_and_flushes_broken_tail():
    tok = tiny_tokenizer()
    dec = tok.incremental_decoder()
    out = "".join(dec.push(i) for i in tok.encode("<|im_start|>ok<|im_end|>"))
    assert out + dec.flush() == "ok"
    dec = tok.incremental_decoder()
    first_byte_of_e_acute = tok.encode("é")[0]
    assert dec.push(first_byte_of_e_acute) == "" and dec.flush() == "\ufffd"


def test_incremental_decoder_decodes_each_id_once(monkeypatch):
    tok = tiny_tokenizer()
    ids = tok.encode("def add(a, b):\n    return a + b  # the sum\n")
    expected = [tok.incremental_decoder().push(i) for i in ids]
    decoded: list[int] = []
    decode = tok.decode

    def counted(some: list[int], skip_special_tokens: bool = False) -> str:
        decoded.extend(some)
        return decode(some, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(tok, "decode", counted)
    dec = tok.incremental_decoder()
    assert [dec.push(i) for i in ids] == expected and decoded == ids
    # a decoder that is not byte-level alone (here wrapped) decodes the released ids again,
    # as context, and releases the same text
    monkeypatch.setattr(tok.backend, "decoder", decoders.Sequence([decoders.ByteLevel()]))
    dec = tok.incremental_decoder()
    assert [dec.push(i) for i in ids] == expected and len(decoded) > 2 * len(ids)


def test_token_text_and_bytes():
    tok = tiny_tokenizer()
    (space_the,) = tok.encode(" the")
    assert tok.token_text(space_the) == " the" and tok.token_bytes(space_the) == b" the"
    assert tok.token_text(2) == "<|im_end|>" and tok.is_special(2) and not tok.is_special(space_the)
    assert tok.token_bytes(tok.encode("é")[0]) == "é".encode()[:1]


def test_a_lone_surrogate_is_an_error_naming_its_position():
    tok = tiny_tokenizer()
    for special in (True, False):
        with pytest.raises(ValueError, match=r"text\[2\]: a lone surrogate \(\\ud83d\)"):
            tok.encode("ab\ud83dc", special=special)
    with pytest.raises(ValueError, match=r"texts\[1\]\[0\]: a lone surrogate \(\\udc80\)"):
        tok.encode_batch(["ok", "\udc80"])
    with pytest.raises(ValueError, match=r"text\[1\]: a lone surrogate"):
        tok.encode_with_offsets("a\ud800")
    with pytest.raises(TypeError, match="text: a str to encode, got bytes"):
        tok.encode(b"ab")  # type: ignore[arg-type]
    assert tok.decode(tok.encode("text beyond the BMP: 😀")) == "text beyond the BMP: 😀"


def test_smollm2_tokenizer_from_the_wheel():
    tok = load_tokenizer()
    assert tok.vocab_size == 49152 and (tok.bos_id, tok.eos_id) == (1, 2)
    assert tok.id_to_token(2) == "<|im_end|>" and len(tok.special.control) == 17
    assert tok.encode("<|im_start|>assistant\n")[0] == 1
    assert "<|im_start|>" in (tok.chat_template or "")


def test_the_bytes_smollm2_has_no_token_for_are_dropped_and_counted():
    tok = load_tokenizer()
    assert tok.missing_bytes == bytes([0x04, 0x06, 0x13, 0x14, 0x16, 0x1d, 0xc0, 0xc1, 0xf1, 0xf2,
                                       *range(0xf5, 0x100)])
    # (U+50000 is f1 90 80 80: the lead byte goes, the rest decode as U+FFFD)
    for text, lost, back in [("a\x16b\x04 = 1", 2, "ab = 1"),
                             ("\U00050000!", 1, "\ufffd" * 3 + "!"),
                             ("ok é 😀 \x1b\x7f", 0, "ok é 😀 \x1b\x7f")]:
        assert tok.dropped_bytes(text) == lost and tok.decode(tok.encode(text)) == back
    assert tiny_tokenizer().missing_bytes == b"" and tiny_tokenizer().dropped_bytes("\x16") == 0


@pytest.mark.slow
def test_ids_equal_hf_auto_tokenizer_from_the_same_gguf():
    from transformers import AutoTokenizer

    from codedojo.model.tokenizer import smollm2_gguf_path

    path = smollm2_gguf_path()
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # HF's GGUF reader splits as GPT-2 whatever tokenizer.ggml.pre says; with the split the
    # model's own pre-tokenizer has (`test_smollm2_splits_text_as_llama_cpp_does`), the
    # vocabulary, merges and special tokens must give the same ids
    from tokenizers import pre_tokenizers

    hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    ours = load_tokenizer()
    code = Path(__file__).read_text() + Path(gguf.__file__).read_text()[:20000]
    samples = TEXTS + [code, "x" * 500 + " " * 40 + "\n" * 7, "Ünïcödé ñ ß ø 日本語 한국어 עברית العربية"]
    for s in samples:
        assert ours.encode(s) == hf(s, add_special_tokens=True)["input_ids"]
        assert ours.decode(ours.encode(s)) == hf.decode(hf(s)["input_ids"])
    assert ours.eos_id == hf.eos_token_id and ours.bos_id == hf.bos_token_id
    # The chat template renders as HF apply_chat_template does (text and ids).
    from codedojo.model.chat import ChatTemplate

    chat = ChatTemplate(ours)
    for msgs in ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                  {"role": "user", "content": "2+2?"}],
                 [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi\n\n  x = 1"}]):
        for gen in (True, False):
            assert chat.render(msgs, add_generation_prompt=gen) == hf.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=gen)
            assert chat.encode(msgs, add_generation_prompt=gen) == hf(
                hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen))["input_ids"]


def test_a_gguf_tokenizer_splits_as_its_pre_tokenizer_says_or_is_refused(tmp_path):
    """GPT-2's split keeps a space with the number after it; SmolLM's (llama.cpp's `smollm`)
    splits off every digit first, so " 1" is never one piece. Qwen2's and Llama 3's split
    their own way: read with either, the ids would not be the model's."""
    table = byte_alphabet()
    tokens = ["<|endoftext|>"] + [table[b] for b in range(256)] + ["ab", table[32] + "1"]
    types = [3] + [1] * 258
    space_one = 258
    for pre, ids in (("gpt-2", [257, space_one]), (None, [257, space_one]),
                     ("smollm", [257, 1 + ord(" "), 1 + ord("1")])):
        path = write_gguf(tmp_path / f"{pre}.gguf", tokens, ["a b", f"{table[32]} 1"], types,
                          pre=pre)
        assert Tokenizer.from_gguf(path).encode("ab 1") == ids, pre
    path = write_gguf(tmp_path / "qwen.gguf", tokens, ["a b"], types, pre="qwen2")
    with pytest.raises(ValueError, match="tokenizer.ggml.pre is 'qwen2'"):
        Tokenizer.from_gguf(path)


@pytest.mark.parametrize("text", [*TEXTS, "x = [\n    1,\n    2,\n]", "a  12 b\t3 ٣ ²",
                                  "v1.2.3 == 10\n\n   42"])
def test_smollm2_splits_text_as_llama_cpp_does(text):
    """llama.cpp's `smollm` pre-tokenizer: each number character alone, then GPT-2's regex over
    the rest (the model's vocabulary has no token with a digit in it, and its merges none)."""
    import regex

    gpt2 = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+"
                         r"|\s+(?!\S)|\s+")
    want = [piece for part in regex.split(r"(\p{N})", text) if part
            for piece in gpt2.findall(part)]
    table = byte_alphabet()
    tok = load_tokenizer()
    got = [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str(text)]
    assert got == ["".join(table[b] for b in w.encode()) for w in want]


def test_a_folder_without_a_tokenizer_says_what_it_lacks(tmp_path):
    """A checkpoint saved without its run's tokenizer is named as one, with what to copy."""
    from codedojo.model.tokenizer import load_tokenizer

    with pytest.raises(FileNotFoundError, match="no tokenizer.json and no .gguf file in this "
                       "directory$"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "model_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="a checkpoint saved without its run's "
                       "tokenizer: copy the run's tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_the_text_reading_backend_is_seen_by_other_threads_only_when_ready(monkeypatch):
    """`encode(special=False)` builds its second backend on first use; a thread that finds it
    set must find it reading control-token text as text already."""
    import codedojo.model.tokenizer as module

    tok = load_tokenizer()
    tok._as_text = None
    real = module._HFTokenizer
    seen: list[object] = []

    class Watched:
        def __init__(self, inner: object) -> None:
            object.__setattr__(self, "inner", inner)

        def __setattr__(self, name: str, value: object) -> None:
            seen.append(tok._as_text)  # what another thread would find as the flag is set
            setattr(self.inner, name, value)

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

    class Factory:
        @staticmethod
        def from_str(text: str) -> Watched:
            return Watched(real.from_str(text))

    monkeypatch.setattr(module, "_HFTokenizer", Factory)
    ids = tok.encode("<|im_end|>", special=False)
    assert seen == [None] and tok.special.eos not in ids
