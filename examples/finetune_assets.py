"""Tiny, local stand-ins for what a user brings to a fine-tune: a Hugging Face base model (a 2-layer
Llama or Qwen2 built with transformers' own config classes and `save_pretrained`), its tokenizer (a
small BPE trained here with the `tokenizers` library on text that ships with Python, with a ChatML
chat template), and chat data in the formats people already use (`messages` JSONL for SFT,
`prompt`/`chosen`/`rejected` JSONL for DPO). Nothing is downloaded.

    python examples/finetune_assets.py DIR [--family llama|qwen2]
    python examples/finetune_assets.py DIR --revision sha256:... --source chat=upload:file-... \
        --source prefs=upload:file-... --source chat-eval=upload:file-... --manifest-out PATH

writes DIR/base (the checkpoint), DIR/sft.jsonl, DIR/dpo.jsonl, DIR/eval.jsonl; with
--manifest-out, a fine-tune manifest naming the base model and the uploaded files (what
`ecc ito models upload` and `ecc ito files upload` answered; examples/manifests/finetune.json is its
template). The demo, the tests and the bench use the same functions.
"""

import argparse
import hashlib
import json
import pathlib
import random
import sys

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 512  # tiny: the embedding is 512 x 64
SYSTEM = "You add and subtract small numbers."


def _corpus() -> list[str]:
    from pydoc_data.topics import topics

    rng = random.Random("finetune-assets")
    sums = [f"{a}+{b}={a + b}" for a, b in ((rng.randrange(50), rng.randrange(50)) for _ in range(2000))]
    return [topics[k] for k in sorted(topics)] + sums


def write_tokenizer(directory: pathlib.Path) -> None:
    """A byte-level BPE with ChatML special tokens: tokenizer.json and tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 256,
        "chat_template": CHAT_TEMPLATE,
        "add_bos_token": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def write_base_model(directory: pathlib.Path, family: str = "llama", seed: int = 0) -> None:
    """A 2-layer model of `family` with the tokenizer above, randomly initialised from `seed`."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a demo's output, not a progress bar per shard

    write_tokenizer(directory)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=tok.token_to_id("<|im_end|>"),
        pad_token_id=tok.token_to_id("<|endoftext|>"),
        bos_token_id=None,
    )
    config = LlamaConfig(**common) if family == "llama" else Qwen2Config(**common, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory, safe_serialization=True)
    for name in ("generation_config.json",):
        (directory / name).unlink(missing_ok=True)  # not part of what the store needs


def _problem(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(10), rng.randrange(10)
    return (f"What is {a}+{b}?", str(a + b)) if rng.random() < 0.5 else (f"What is {a}-{b}?", str(a - b))


def write_chat_data(directory: pathlib.Path, *, rows: int = 400, seed: int = 0) -> dict[str, pathlib.Path]:
    """sft.jsonl (messages), dpo.jsonl (prompt/chosen/rejected) and eval.jsonl (messages, other
    problems' seed): the field's shapes, as OpenAI, Together and TRL take them."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, offset in (("sft", 0), ("eval", 1)):
        rng = random.Random(f"chat:{seed + offset}")
        lines = []
        for _ in range(rows if name == "sft" else rows // 4):
            question, answer = _problem(rng)
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer},
            ]
            lines.append(json.dumps({"messages": messages}))
        paths[name] = directory / f"{name}.jsonl"
        paths[name].write_text("\n".join(lines) + "\n")
    rng = random.Random(f"dpo:{seed}")
    lines = []
    for _ in range(rows):
        question, answer = _problem(rng)
        wrong = str(int(answer) + rng.choice([-2, -1, 1, 2]))
        lines.append(json.dumps({"prompt": question, "chosen": answer, "rejected": wrong}))
    paths["dpo"] = directory / "dpo.jsonl"
    paths["dpo"].write_text("\n".join(lines) + "\n")
    return paths


def sha256_file(path: pathlib.Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def finetune_manifest(
    template: pathlib.Path, *, base: str, revision: str, sources: dict[str, str]
) -> dict[str, object]:
    """The template manifest with the base model's name and digest and each data ref's source
    (`upload:<file id>` as `ecc ito files upload` answered it) filled in."""
    manifest = json.loads(template.read_text())
    manifest["model"]["base"] = base
    manifest["model"]["revision"] = revision
    for ref in manifest["data"]:
        ref["source"] = sources[ref["name"]]
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=pathlib.Path)
    parser.add_argument("--family", choices=("llama", "qwen2"), default="llama")
    parser.add_argument("--manifest-out", type=pathlib.Path, help="write the fine-tune manifest here")
    parser.add_argument("--base-name", default="tiny-llama", help="the base model's name (`ecc ito models`)")
    parser.add_argument(
        "--revision", default="", help="the base's digest (`ecc ito models upload` prints it)"
    )
    parser.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="NAME=SOURCE",
        help="a data ref's source, e.g. chat=upload:file-... (as `ecc ito files upload` answered it)",
    )
    args = parser.parse_args(argv)
    root = args.directory.absolute()
    if not (root / "base" / "config.json").exists():
        write_base_model(root / "base", args.family)
    write_chat_data(root)
    if args.manifest_out is not None:
        template = pathlib.Path(__file__).resolve().parent / "manifests" / "finetune.json"
        sources = dict(s.split("=", 1) for s in args.source)
        manifest = finetune_manifest(template, base=args.base_name, revision=args.revision, sources=sources)
        args.manifest_out.write_text(json.dumps(manifest, indent=2) + "\n")
        args.manifest_out.chmod(0o600)
    print(root / "base")
    return 0


if __name__ == "__main__":
    sys.exit(main())
