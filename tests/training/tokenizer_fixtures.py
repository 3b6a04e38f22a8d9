"""A ChatML template with {% generation %} tags, conversations, and a small BPE tokenizer trained on
CPython's help texts: shared by the tokenizer and chat data tests (nothing is downloaded)."""

import json
from pathlib import Path

CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# the same with the turn's closing newline inside the generation block: what a prefix render marks
CHATML_NL = CHATML.replace(
    "'<|im_end|>' }}{% endgeneration %}{{ '\\n' }}", "'<|im_end|>\\n' }}{% endgeneration %}"
)
PLAIN_CHATML = CHATML.replace("{% generation %}", "").replace("{% endgeneration %}", "")

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}],
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "Seven."},
        {"role": "user", "content": "Another one, with ünïcödé 🙂?"},
        {"role": "assistant", "content": "Eleven,\nand thirteen."},
    ],
    [
        {"role": "user", "content": "Say nothing."},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Now say 'for x in range(3):'"},
        {"role": "assistant", "content": "for x in range(3):"},
    ],
]


def train_bpe(path: Path, *, template: str, bos: bool = False) -> Path:
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    texts = [topics[k] for k in sorted(topics)][:60]
    raw.train_from_iterator(texts, trainer=trainer)
    if bos:  # as Llama's tokenizer.json does; transformers ignores the config's add_bos_token
        from tokenizers.processors import TemplateProcessing

        raw.post_processor = TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", raw.token_to_id("<s>"))]
        )
    path.mkdir(parents=True, exist_ok=True)
    raw.save(str(path / "tokenizer.json"))
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": template,
    }
    if bos:
        config |= {"bos_token": {"__type": "AddedToken", "content": "<s>", "special": True}}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path
