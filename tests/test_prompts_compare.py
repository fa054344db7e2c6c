"""The prompt-file format, the default prompt set, and the comparison report's rules."""

from __future__ import annotations

import json

import pytest

from kvcourse.harness.compare import TIE_GAP, Comparison, Row, compare, first_difference, format_rows
from kvcourse.harness.prompts import (
    PREFIX_PROMPTS,
    Prompt,
    encode,
    load_tokenizer,
    max_new_tokens_of,
    parse_prompt,
    read_prompts,
)
from kvcourse.harness.reference import Reference


def write_jsonl(path, objs):
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


def test_read_prompts_both_kinds_and_max_new_tokens(tmp_path):
    f = write_jsonl(
        tmp_path / "p.jsonl",
        [{"messages": [{"role": "user", "content": "hi"}], "max_new_tokens": 5}, {"text": "raw"}],
    )
    chat, raw = read_prompts(f)
    assert chat.messages == (("user", "hi"),) and chat.max_new_tokens == 5
    assert raw.text == "raw" and raw.max_new_tokens is None
    assert max_new_tokens_of([chat, raw], 64) == [5, 64]


@pytest.mark.parametrize(
    "obj, message",
    [
        ({"text": "a", "messages": []}, "exactly one of"),
        ({}, "exactly one of"),
        ({"text": ""}, "non-empty string"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "user"}]}, "string 'role' and 'content'"),
        ({"text": "a", "max_new_tokens": 0}, "positive integer"),
        ({"text": "a", "max_new_tokens": True}, "positive integer, got True"),
        (
            {"text": "a", "max_tokens": 5},
            r"unknown key 'max_tokens' \(allowed: messages, text, max_new_tokens\)",
        ),
        ({"messages": [{"role": "user", "content": "x", "name": "n"}]}, "unknown message key 'name'"),
    ],
)
def test_bad_prompt_lines_are_named(obj, message):
    with pytest.raises(ValueError, match=message):
        parse_prompt(obj)


def test_missing_empty_and_binary_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="prompt file .*nope.jsonl does not exist"):
        read_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(ValueError, match="empty.jsonl: no prompts"):
        read_prompts(tmp_path / "empty.jsonl")
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="bin.jsonl: not a UTF-8 text file"):
        read_prompts(tmp_path / "bin.jsonl")


def test_bad_json_names_file_and_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: not valid JSON"):
        read_prompts(f)


def test_default_prompt_set_meets_the_design(model_dir):
    prompts = read_prompts()
    chats = [p for p in prompts if p.messages]
    assert len(chats) >= 8 and any(p.text for p in prompts)
    tok = load_tokenizer(model_dir)
    lengths = [len(encode(tok, p)) for p in prompts]
    assert len(set(lengths)) >= 5, "prompt lengths should vary"
    # at least one prompt whose prompt + generation crosses several 16-token block boundaries
    assert any(n + b >= 4 * 16 for n, b in zip(lengths, max_new_tokens_of(prompts, 64), strict=True))


def test_chat_template_and_raw_encoding(model_dir):
    tok = load_tokenizer(model_dir)
    chat = encode(tok, Prompt(messages=(("user", "Hi"),)))
    assert tok.decode(chat).endswith("<|im_start|>assistant\n")
    assert tok.decode(encode(tok, Prompt(text="Once upon"))) == "Once upon"


def auto_tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


@pytest.mark.parametrize("checkpoint", ["course", "tiny_llama", "tiny_qwen3"])
def test_load_tokenizer_gives_what_auto_tokenizer_gives(checkpoint, request):
    """load_tokenizer skips AutoTokenizer where tokenizer_config.json names the generic fast class: the
    same class, and the same ids for every prompt of both shipped prompt files, as AutoTokenizer's."""
    folder = request.getfixturevalue("model_dir" if checkpoint == "course" else f"{checkpoint}_dir")
    fast, auto = load_tokenizer(folder), auto_tokenizer(folder)
    assert type(fast) is type(auto)
    for prompt in read_prompts() + read_prompts(PREFIX_PROMPTS):
        assert encode(fast, prompt) == encode(auto, prompt), prompt.label


def test_load_tokenizer_leaves_any_other_class_to_auto_tokenizer(model_dir, tmp_path, monkeypatch):
    """A checkpoint naming another tokenizer class is loaded by AutoTokenizer, which picks that class; so
    is one whose tokenizer_config.json is not a config, and AutoTokenizer's error is the one raised."""
    import transformers

    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {"tokenizer_class": "GPT2Tokenizer"}))
    seen = []
    original = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: seen.append(a) or original(*a, **k))
    tok = load_tokenizer(tmp_path)
    assert seen and type(tok) is type(auto_tokenizer(tmp_path))
    assert encode(tok, Prompt(text="Once upon")) == encode(load_tokenizer(model_dir), Prompt(text="Once upon"))
    seen.clear()
    (tmp_path / "tokenizer_config.json").write_text('["not", "a config"]')  # AutoTokenizer says what is wrong
    with pytest.raises(Exception) as raised:
        load_tokenizer(tmp_path)
    assert seen, f"not left to AutoTokenizer: {raised.value!r}"


def test_first_difference_examples():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_tie_rule_applies_only_below_the_gap():
    hf = Reference([1, 2, 3], [5.0, TIE_GAP / 2, 5.0])
    tie = compare([1, 2, 3], [1, 9, 9], hf)
    assert tie.ok and tie.first_diff == 1 and tie.status == "tie@1"
    real = compare([1, 2, 3], [9, 2, 3], hf)
    assert not real.ok and real.status == "DIFF@0"
    assert compare([1, 2, 3], [1, 2, 3], hf).status == "match"


def test_compare_docstring_examples():
    hf = Reference([5, 9, 4], [2.0, 1e-4, 3.0])
    assert compare([5, 9, 4], [5, 7, 1], hf).status == "tie@1"
    assert compare([5, 9, 4], [5, 9], hf).status == "DIFF@2"
    assert compare([5, 8, 4], [5, 8, 6], hf).status == "DIFF@2"


def test_a_missing_token_is_never_a_tie():
    """An engine that stops early differs where its output ends: there it picked nothing, so even a
    near-tie in HF's logits at that position is not a tie."""
    hf = Reference([1, 2, 3], [5.0, TIE_GAP / 2, TIE_GAP / 2])
    assert compare([1, 2, 3], [1], hf).status == "DIFF@1"
    assert compare([1, 2, 3], [1, 2, 3, 7], hf).status == "DIFF@3"


def test_previous_stage_ties_only_while_it_still_agrees_with_hf():
    """HF's gaps describe HF's text. Once the previous stage has tied away from HF (position 1), its
    continuation is another text: a later difference from it is a mismatch, whatever HF's gap says."""
    hf = Reference([1, 2, 3, 4], [5.0, TIE_GAP / 2, TIE_GAP / 2, 5.0])
    prev_agrees = [1, 2, 3, 4]
    assert compare(prev_agrees, [1, 2, 8, 8], hf).status == "tie@2"
    prev_tied_away = [1, 9, 3, 4]
    assert compare(prev_tied_away, [1, 2, 3, 4], hf).status == "tie@1"  # at 1 it is still HF's text
    assert compare(prev_tied_away, [1, 9, 8, 4], hf).status == "DIFF@2"  # at 2 it no longer is


def test_report_shows_ties_and_hf_text():
    rows = [
        Row("a", Comparison(None), None, "same", "same"),
        Row("b", Comparison(4, 2e-4), None, "mine", "theirs"),
        Row("c", Comparison(0), None, "wrong", "right"),
    ]
    text = format_rows(rows, None)
    assert "numerical tie vs HF at position 4" in text and "HF top-2 gap 2.0e-04" in text
    assert "DIFF@0" in text and "HF: right" in text
    assert [r.ok for r in rows] == [True, True, False] and rows[1].tie
