from __future__ import annotations

import pytest

from codedojo.data.mixture import MixtureSource, mix
from codedojo.data.packing import make_batch, pack
from codedojo.data.readers import Document
from codedojo.data.sft import code_sft_examples, render_to_shards


@pytest.fixture(scope="module")
def chat():
    from codedojo.model.chat import ChatTemplate
    from codedojo.model.tokenizer import load_tokenizer

    tok = load_tokenizer()
    return tok, ChatTemplate(tok)


def test_sft_loss_only_on_assistant_tokens(tmp_path, chat):
    tok, tmpl = chat
    src = 'def add(a, b):\n    """Add two numbers."""\n    return a + b\n\n\n' \
          'def sub(a, b):\n    """Subtract b from a."""\n    return a - b\n'
    convs = list(code_sft_examples([Document(src, "m.py", {"path": "m.py"})]))
    assert len(convs) == 2 and convs[1][1] is not None  # a plain chat and a tool trajectory
    render_to_shards(convs, tmpl.render_with_mask, tmp_path, tok.vocab_size, tok.eos_id)
    docs = list(mix([MixtureSource(name="sft", path=str(tmp_path))], 2000, seed=0))
    p = pack(docs[:2], seq_len=2048)
    b = make_batch(p.tokens, p.segments, p.mask)
    trained = b["targets"][b["loss_mask"]].tolist()
    untrained = b["targets"][~b["loss_mask"]].tolist()
    text = tok.decode(trained)
    assert "return a + b" in text and "return a - b" in text
    assert "read_file" in text  # the assistant's tool call is trained ...
    assert "Write the Python function" not in text  # ... the user's request is not
    assert "Write the Python function" in tok.decode(untrained)


def test_a_conversation_opening_with_the_assistant_is_rendered(tmp_path, chat):
    tok, tmpl = chat
    convs = [([{"role": "assistant", "content": "Hi, what shall we fix?"},
               {"role": "user", "content": "main.py"},
               {"role": "assistant", "content": "On it."}], None)]
    render_to_shards(convs, tmpl.render_with_mask, tmp_path, tok.vocab_size, tok.eos_id)
    (doc,) = list(mix([MixtureSource(name="sft", path=str(tmp_path))], 2000, seed=0))[:1]
    p = pack([doc], seq_len=2048)
    b = make_batch(p.tokens, p.segments, p.mask)
    assert tok.decode(b["targets"][b["loss_mask"]].tolist()) == (
        "Hi, what shall we fix?<|im_end|>On it.<|im_end|>")


def test_a_conversation_the_renderer_refuses_is_named_by_its_file_and_line(tmp_path, chat):
    from codedojo.data.sft import read_sft_jsonl

    tok, tmpl = chat
    sft = tmp_path / "sft.jsonl"
    ok = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}]}'
    sft.write_text(ok + "\n" + ok.replace('"content": "a"', '"content": 3') + "\n")
    with pytest.raises(ValueError, match=r"sft.jsonl:2: messages\[1\]\.content must be a string"):
        render_to_shards(read_sft_jsonl(sft), tmpl.render_with_mask, tmp_path / "out",
                         tok.vocab_size, tok.eos_id)
    with pytest.raises(ValueError, match=r"^conversation 0: messages\[1\]\.content"):
        render_to_shards([([{"role": "user", "content": "hi"},
                            {"role": "assistant", "content": 3}], None)],
                         tmpl.render_with_mask, tmp_path / "out2", tok.vocab_size, tok.eos_id)


def test_a_decorated_function_is_trained_with_its_decorators_and_bad_bytes_name_the_line(
        tmp_path):
    from codedojo.data.sft import read_sft_jsonl

    src = ("import functools\n\n\n@functools.lru_cache(maxsize=None)\ndef fib(n):\n"
           '    """The n-th Fibonacci number."""\n    return n if n < 2 else fib(n - 1) + '
           "fib(n - 2)\n")
    conv = next(iter(code_sft_examples([Document(src, "m.py", {"path": "m.py"})])))
    answer = conv.messages[-1]["content"]
    assert "@functools.lru_cache(maxsize=None)\ndef fib(n):" in answer
    bad = tmp_path / "sft.jsonl"
    ok = b'{"messages": [{"role": "assistant", "content": "a"}]}\n'
    bad.write_bytes(ok + b'{"messages": [{"role": "assistant", "content": "caf\xe9"}]}\n')
    with pytest.raises(ValueError, match=r"sft.jsonl:2: not UTF-8 \(byte 51\)"):
        list(read_sft_jsonl(bad))


def test_a_file_that_starts_with_a_byte_order_mark_is_read(tmp_path):
    from codedojo.data.sft import read_sft_jsonl

    sft = tmp_path / "sft.jsonl"
    row = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", ' \
        b'"content": "yo"}]}'
    sft.write_bytes(b"\xef\xbb\xbf" + row + b"\n" + row + b"\n")
    assert [c.messages[-1]["content"] for c in read_sft_jsonl(sft)] == ["yo", "yo"]


def test_a_file_nested_past_what_the_parser_builds_is_skipped_like_one_that_does_not_parse():
    """A 3000-branch elif chain (RecursionError) or a 30000-deep expression (MemoryError) in
    one file leaves the other files' examples to be built."""
    ladder = ('def code(x):\n    """Map x to its code."""\n    if x == 0:\n        return 0\n'
              + "".join(f"    elif x == {i}:\n        return {i}\n" for i in range(1, 3000)))
    deep = "x = \\\n" + "not \\\n" * 30000 + "y\n"
    ok = 'def add(a, b):\n    """Add two numbers."""\n    return a + b\n'
    docs = [Document(t, f"{n}.py", {"path": f"{n}.py"})
            for n, t in (("ladder", ladder), ("deep", deep), ("ok", ok))]
    assert [c.where for c in code_sft_examples(docs)] == ["ok.py: add"]


def test_a_function_after_a_page_break_keeps_its_body():
    """ast ends lines at \\n, \\r\\n and \\r only: a form feed (a page break in GNU-style code)
    or a line separator inside a comment does not shift the lines a function is cut from."""
    area = 'def area(w, h):\n    """Area of a rectangle."""\n    return w * h\n'
    perimeter = ('def perimeter(w, h):\n    """Perimeter of a rectangle."""\n'
                 "    # w + h:\u2028both sides\x85once\n    return 2 * (w + h)\n")
    src = f'"""Module."""\nimport os\n\x0c\n\n{area}\n{perimeter}'
    answers = [c.messages[-1]["content"]
               for c in code_sft_examples([Document(src, "m.py", {"path": "m.py"})])]
    assert answers == [f"```python\n{area}```", f"```python\n{perimeter}```"]
