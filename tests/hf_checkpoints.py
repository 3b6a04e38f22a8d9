"""Tiny Hugging Face checkpoints and tokenizers built in the test (nothing is downloaded): a 2-layer
Llama or Qwen2 saved with transformers' own `save_pretrained`, and a small BPE tokenizer trained with
`tokenizers` on a few sentences."""

import json
import pathlib

TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "a model store keeps checkpoints by their content digest",
    "tokens and embeddings must agree at plan time",
] * 20


def train_tokenizer(out: pathlib.Path, vocab_size: int = 300, chat_template: bool = True) -> pathlib.Path:
    """tokenizer.json (+ tokenizer_config.json) of a byte-level BPE with at most `vocab_size` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXT, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template:
        config["chat_template"] = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def save_tiny(
    out: pathlib.Path,
    family: str = "llama",
    *,
    vocab_size: int = 320,
    tokenizer_vocab: int | None = 300,
    tie: bool = False,
) -> pathlib.Path:
    """A 2-layer `family` ("llama" or "qwen2") model with random weights in HF layout; with a
    tokenizer of at most `tokenizer_vocab` tokens unless None."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
    )
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    model.save_pretrained(out)
    if tokenizer_vocab is not None:
        train_tokenizer(out, tokenizer_vocab)
    return out


def word_tokenizer(out: pathlib.Path, vocab_size: int) -> pathlib.Path:
    """A tokenizer.json with exactly `vocab_size` tokens (a word-level vocabulary, built, not
    trained): the stored tokenizer a from-scratch size's vocab_size needs in a test."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0} | {f"w{i}": i for i in range(1, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out
