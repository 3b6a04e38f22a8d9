"""The trainer's tokenizers against transformers: a BPE trained here on CPython's help texts, a
ChatML template with {% generation %} tags, and the byte tokenizer's files."""

import json
from pathlib import Path

import pytest

from tests.training.tokenizer_fixtures import CHATML, CHATML_NL, CONVERSATIONS, PLAIN_CHATML, train_bpe
from training.data import corpora
from training.data.tokenizer import (
    ByteTokenizer,
    HfTokenizer,
    Tokenizer,
    byte_tokenizer_files,
    load_tokenizer,
    tokenizer_files,
)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_bpe(tmp_path_factory.mktemp("bpe"), template=CHATML)


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_chat_ids_and_assistant_mask_equal_transformers(bpe_dir: Path, index: int) -> None:
    ours = HfTokenizer.from_dir(bpe_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(bpe_dir)
    conversation = CONVERSATIONS[index]
    out = theirs.apply_chat_template(
        conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = ours.chat(conversation)
    assert ids == list(out["input_ids"])
    assert mask == list(out["assistant_masks"])
    assert sum(mask) > 0
    # the masked tokens are the assistant's words and the end of each turn, nothing else
    masked = ours.decode([t for t, m in zip(ids, mask, strict=True) if m])
    expected = "".join(m["content"] + "<|im_end|>" for m in conversation if m["role"] == "assistant")
    assert masked == expected
    prompt = conversation[:-1]
    theirs_prompt = theirs.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)
    if not isinstance(theirs_prompt, list):
        theirs_prompt = theirs_prompt["input_ids"]
    assert ours.chat(prompt, add_generation_prompt=True)[0] == list(theirs_prompt)


def test_prefix_rendering_finds_the_same_turns_without_generation_tags(bpe_dir: Path, tmp_path: Path) -> None:
    assert CHATML_NL != CHATML
    tagged_dir = tmp_path / "tagged"
    tagged_dir.mkdir()
    (tagged_dir / "tokenizer.json").write_bytes((bpe_dir / "tokenizer.json").read_bytes())
    (tagged_dir / "chat_template.jinja").write_text(CHATML_NL)
    (tagged_dir / "tokenizer_config.json").write_bytes((bpe_dir / "tokenizer_config.json").read_bytes())
    tagged = HfTokenizer.from_dir(tagged_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(tagged_dir)
    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    (plain_dir / "tokenizer.json").write_bytes((bpe_dir / "tokenizer.json").read_bytes())
    config = json.loads((bpe_dir / "tokenizer_config.json").read_text())
    (plain_dir / "chat_template.jinja").write_text(PLAIN_CHATML)  # wins over the config's
    config["chat_template"] = "{{ raise_exception('the config template is not the one used') }}"
    (plain_dir / "tokenizer_config.json").write_text(json.dumps(config))
    plain = HfTokenizer.from_dir(plain_dir)
    for conversation in CONVERSATIONS:
        out = theirs.apply_chat_template(conversation, return_dict=True, return_assistant_tokens_mask=True)
        assert tagged.chat(conversation) == (list(out["input_ids"]), list(out["assistant_masks"]))
        assert plain.chat(conversation) == tagged.chat(conversation)


# Qwen3's habit: an empty think block only in the assistant turns after the last user message,
# so a conversation's prefix does not render as a prefix of it
THINKING = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_user %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_turns_of_a_template_that_renders_the_last_turn_differently(bpe_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "thinking"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((bpe_dir / "tokenizer.json").read_bytes())
    (d / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "chat_template": THINKING})
    )
    tok = HfTokenizer.from_dir(d)
    ids, mask = tok.chat(CONVERSATIONS[1])
    assert tok.decode(ids).count("<think>") == 1
    masked = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert masked == "Seven.<|im_end|><think>\n\n</think>\n\nEleven,\nand thirteen.<|im_end|>\n"


def test_template_errors_and_special_tokens_reach_the_template(bpe_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "t"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((bpe_dir / "tokenizer.json").read_bytes())
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] + eos_token }}{% endfor %}"
    )
    (d / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "chat_template": template})
    )
    tok = HfTokenizer.from_dir(d)
    ids, _ = tok.chat([{"role": "user", "content": "hi"}])
    assert ids[-1] == tok.eos_id
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="user first"):
        tok.chat([{"role": "assistant", "content": "hi"}])


def test_bos_and_special_ids_follow_the_config(tmp_path: Path) -> None:
    d = train_bpe(tmp_path / "llama", template=CHATML, bos=True)
    ours = HfTokenizer.from_dir(d)
    theirs = transformers.AutoTokenizer.from_pretrained(d)
    assert ours.bos_id == theirs.bos_token_id is not None
    assert theirs.encode("hello there")[0] == ours.bos_id
    assert theirs.encode("hello there")[1:] == ours.encode("hello there")
    assert (ours.eos_id, ours.pad_id) == (theirs.eos_token_id, theirs.pad_token_id)
    assert ours.vocab_size == len(theirs)
    plain = train_bpe(tmp_path / "qwen", template=CHATML)
    assert HfTokenizer.from_dir(plain).bos_id is None
    assert isinstance(ours, Tokenizer)


UNICODE = "héllo wörld 🙂 Ċ Ā\n\x00 tab\t  spaces  日本語 \u200d end"


def test_byte_tokenizer_files_load_in_transformers_and_encode_as_bytes(tmp_path: Path) -> None:
    for name, raw in byte_tokenizer_files().items():
        (tmp_path / name).write_bytes(raw)
    byte = ByteTokenizer()
    for cls in (transformers.AutoTokenizer, transformers.PreTrainedTokenizerFast):
        theirs = cls.from_pretrained(tmp_path)
        for text in (UNICODE, "", "plain ascii", "12+35=47\n"):
            assert theirs.encode(text) == byte.encode(text) == list(text.encode("utf-8"))
            assert theirs.decode(byte.encode(text)) == byte.decode(byte.encode(text)) == text
        assert (theirs.eos_token_id, theirs.pad_token_id, len(theirs)) == (byte.eos_id, byte.pad_id, 256)
    ours = HfTokenizer.from_dir(tmp_path)
    assert ours.encode(UNICODE) == byte.encode(UNICODE)
    assert (ours.eos_id, ours.bos_id, ours.pad_id, ours.vocab_size) == (10, None, 0, 256)


def test_byte_tokenizer_is_the_same_from_data() -> None:
    assert corpora.ByteTokenizer is ByteTokenizer
    tok = corpora.ByteTokenizer()
    assert tok.encode("é") == [195, 169]
    assert tok.decode(tok.encode_tensor("12+35=47")) == "12+35=47"
    assert tok.decode([0xFF]) == "\ufffd"
    ids, mask = tok.chat(
        [{"role": "user", "content": "12+35="}, {"role": "assistant", "content": "47"}],
    )
    assert tok.decode(ids) == "user: 12+35=\nassistant: 47\n"
    assert tok.decode([t for t, m in zip(ids, mask, strict=True) if m]) == "47\n"
    assert ids[-1] == tok.eos_id == ord("\n")
    prompt, prompt_mask = tok.chat([{"role": "user", "content": "1+1="}], add_generation_prompt=True)
    assert tok.decode(prompt).endswith("assistant: ") and not any(prompt_mask)


def test_load_tokenizer_specs(bpe_dir: Path, tmp_path: Path) -> None:
    assert isinstance(load_tokenizer("bytes", bpe_dir, None), ByteTokenizer)
    assert isinstance(load_tokenizer(None, None, None), ByteTokenizer)
    own = load_tokenizer(None, bpe_dir, None)
    assert isinstance(own, HfTokenizer) and own.has_chat_template
    digest = "ab" * 32
    entry = tmp_path / "store" / "tokenizers" / digest
    entry.mkdir(parents=True)
    for name, raw in tokenizer_files(bpe_dir).items():
        (entry / name).write_bytes(raw)
    by_digest = load_tokenizer(f"sha256:{digest}", None, tmp_path / "store")
    assert isinstance(by_digest, HfTokenizer) and by_digest.id == f"sha256:{digest}"
    assert by_digest.encode("some text") == own.encode("some text")
    with pytest.raises(ValueError, match="no tokenizer"):
        load_tokenizer("sha256:" + "cd" * 32, None, tmp_path / "store")
    with pytest.raises(ValueError, match="bytes"):
        load_tokenizer("md5:00", None, tmp_path / "store")
    assert set(tokenizer_files(bpe_dir)) == {"tokenizer.json", "tokenizer_config.json"}
