"""Post-training data from the field's rows: SFT examples from `messages`, DPO pairs from
`prompt` / `chosen` / `rejected`, RLVR prompts from `prompt` + `answer` + a named verifier.

Layouts follow TRL's collators (trl/trainer/sft_trainer.py `DataCollatorForLanguageModeling`,
trl/trainer/dpo_trainer.py `DataCollatorForPreference`): right padding, `labels` = -100 wherever
no loss is taken, DPO's chosen rows first and then the rejected rows, a `completion_mask`. Our
trainer takes next-token (inputs, targets, mask) triples, as `posttrain.response_batch` builds
them; `shifted` turns either batch into one.

SFT: the conversation rendered with the tokenizer's chat template (the byte tokenizer's fixed
rendering without one), labels only on the assistant's tokens (`Tokenizer.chat`'s mask), cut to
`seq_len + 1` tokens so the shifted inputs fit a model of `max_seq_len = seq_len`.

DPO: the prompt is one user message rendered with the generation prompt when the tokenizer has a
chat template, else the raw text; chosen and rejected are completions: their tokens and eos (as
TRL's DPOTrainer adds eos to non-conversational completions).

RLVR verifiers are pure functions of (response, answer), declared by name: training/data/
verifiers.py (`exact`, `number`, `math`, `choice`, `regex`, and the format reward's tag).
"""

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from contracts.manifest import DataFormat
from runtime.storage.data_files import iter_batches
from training.data.tokenizer import Message, Tokenizer
from training.data.verifiers import VERIFIER_FUNCTIONS, last_number, verify  # noqa: F401 (re-exported)

IGNORE = -100  # the label of a token without loss (PyTorch's cross_entropy ignore_index, TRL's)


# --- rows ----------------------------------------------------------------------------------------


def _string(row: Mapping[str, Any], column: str, where: str) -> str:
    value = row.get(column)
    if not isinstance(value, str):
        raise ValueError(f"{where}: {column} must be a string, not {type(value).__name__}.")
    return value


def _messages(row: Mapping[str, Any], where: str) -> list[dict[str, str]]:
    value = row.get("messages")
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: messages must be a non-empty list of {{role, content}}.")
    out = []
    for i, m in enumerate(value):
        if (
            not isinstance(m, Mapping)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise ValueError(f"{where}: messages[{i}] needs string role and content.")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def iter_rows(path: Path, fmt: DataFormat, columns: list[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row number, row) of a JSONL or Parquet file, streamed."""
    n = 0
    for batch in iter_batches(Path(path), fmt, columns):
        for row in batch:
            yield n, row
            n += 1


def messages_rows(path: Path, fmt: DataFormat) -> Iterator[list[dict[str, str]]]:
    for n, row in iter_rows(path, fmt, ["messages"]):
        yield _messages(row, f"{Path(path).name} row {n + 1}")


def preference_rows(path: Path, fmt: DataFormat) -> Iterator[tuple[str, str, str]]:
    for n, row in iter_rows(path, fmt, ["prompt", "chosen", "rejected"]):
        where = f"{Path(path).name} row {n + 1}"
        yield _string(row, "prompt", where), _string(row, "chosen", where), _string(row, "rejected", where)


def verifiable_rows(path: Path, fmt: DataFormat) -> Iterator[tuple[str, str]]:
    for n, row in iter_rows(path, fmt, ["prompt", "answer"]):
        where = f"{Path(path).name} row {n + 1}"
        yield _string(row, "prompt", where), _string(row, "answer", where)


# --- SFT -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SftExample:
    input_ids: list[int]
    labels: list[int]  # the id where the assistant wrote it, IGNORE elsewhere

    @property
    def trained_tokens(self) -> int:
        return sum(label != IGNORE for label in self.labels)


def sft_example(tokenizer: Tokenizer, messages: Sequence[Message], seq_len: int) -> SftExample:
    """One conversation as an SFT example, cut to seq_len + 1 tokens (keeping the start)."""
    if seq_len < 1:
        raise ValueError("seq_len must be at least 1.")
    ids, mask = tokenizer.chat(messages)
    ids, mask = ids[: seq_len + 1], mask[: seq_len + 1]
    return SftExample(ids, [t if m else IGNORE for t, m in zip(ids, mask, strict=True)])


def sft_examples(
    tokenizer: Tokenizer,
    conversations: Iterator[Sequence[Message]] | Sequence[Sequence[Message]],
    seq_len: int,
) -> Iterator[SftExample]:
    """Examples of the conversations, leaving out those with no assistant token left after the cut
    (they would add nothing to the loss)."""
    for messages in conversations:
        example = sft_example(tokenizer, messages, seq_len)
        if example.trained_tokens:
            yield example


@dataclass(frozen=True, slots=True)
class SftBatch:
    """TRL's DataCollatorForLanguageModeling output: (B, T) each, right-padded."""

    input_ids: torch.Tensor  # pad_id in the padding
    labels: torch.Tensor  # IGNORE in the padding
    attention_mask: torch.Tensor  # 1 on real tokens
    pad_id: int


def _pad(rows: Sequence[Sequence[int]], value: int) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(list(r), dtype=torch.long)
    return out


def collate_sft(examples: Sequence[SftExample], pad_id: int) -> SftBatch:
    if not examples:
        raise ValueError("A batch needs at least one example.")
    return SftBatch(
        input_ids=_pad([e.input_ids for e in examples], pad_id),
        labels=_pad([e.labels for e in examples], IGNORE),
        attention_mask=_pad([[1] * len(e.input_ids) for e in examples], 0),
        pad_id=pad_id,
    )


# --- DPO -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PreferencePair:
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]


def prompt_ids(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """A prompt as the model sees it before answering: a user turn and the generation prompt
    under a chat template, else the raw text (the byte demo's "12+35=")."""
    if tokenizer.has_chat_template:
        return tokenizer.chat([{"role": "user", "content": prompt}], add_generation_prompt=True)[0]
    return [*([] if tokenizer.bos_id is None else [tokenizer.bos_id]), *tokenizer.encode(prompt)]


def completion_ids(tokenizer: Tokenizer, completion: str) -> list[int]:
    return [*tokenizer.encode(completion), tokenizer.eos_id]


def preference_pair(tokenizer: Tokenizer, prompt: str, chosen: str, rejected: str) -> PreferencePair:
    return PreferencePair(
        prompt_ids(tokenizer, prompt), completion_ids(tokenizer, chosen), completion_ids(tokenizer, rejected)
    )


@dataclass(frozen=True, slots=True)
class PreferenceBatch:
    """TRL's DataCollatorForPreference output: (2B, T), the B chosen rows then the B rejected ones."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor  # 1 on the chosen / rejected completion's tokens
    pad_id: int


def collate_preference(
    pairs: Sequence[PreferencePair],
    pad_id: int,
    *,
    max_length: int | None = None,
    truncation_mode: str = "keep_start",
) -> PreferenceBatch:
    """As TRL's collator: prompt + completion per row, cut to `max_length` (keep_start or
    keep_end) before padding on the right."""
    if not pairs:
        raise ValueError("A batch needs at least one pair.")
    seqs = [p.prompt_ids + p.chosen_ids for p in pairs] + [p.prompt_ids + p.rejected_ids for p in pairs]
    masks = [[0] * len(p.prompt_ids) + [1] * len(p.chosen_ids) for p in pairs] + [
        [0] * len(p.prompt_ids) + [1] * len(p.rejected_ids) for p in pairs
    ]
    if max_length is not None:
        if truncation_mode == "keep_start":
            cut = slice(None, max_length)
        elif truncation_mode == "keep_end":
            cut = slice(-max_length, None)
        else:
            raise ValueError(f"Truncation mode {truncation_mode!r} is neither keep_start nor keep_end.")
        seqs, masks = [s[cut] for s in seqs], [m[cut] for m in masks]
    return PreferenceBatch(
        input_ids=_pad(seqs, pad_id),
        attention_mask=_pad([[1] * len(s) for s in seqs], 0),
        completion_mask=_pad(masks, 0),
        pad_id=pad_id,
    )


# --- to the trainer's next-token triples ---------------------------------------------------------


def shifted(batch: SftBatch | PreferenceBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, targets, mask) of width T - 1: inputs[t] predicts targets[t] = ids[t + 1]; mask is
    1.0 where that target is trained (an assistant / completion token), as `posttrain.response_batch`
    returns them (bit for bit on the byte demo's rows). An input whose target is padding is the pad
    id too: a row's last token predicts nothing."""
    ids = batch.input_ids
    trained = batch.labels != IGNORE if isinstance(batch, SftBatch) else batch.completion_mask.bool()
    inputs = ids[:, :-1].masked_fill(batch.attention_mask[:, 1:] == 0, batch.pad_id)
    return inputs, ids[:, 1:], trained[:, 1:].float()


# --- RLVR ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RlvrPrompt:
    prompt: str
    answer: str
    verifier: str
    prompt_ids: list[int]


def rlvr_prompts(
    tokenizer: Tokenizer, rows: Iterator[tuple[str, str]] | Sequence[tuple[str, str]], verifier: str
) -> list[RlvrPrompt]:
    """The prompts to roll out, tokenized as DPO's are, each with its answer and verifier."""
    if verifier not in VERIFIER_FUNCTIONS:
        raise ValueError(f"Verifier {verifier!r} is unknown: use one of {', '.join(VERIFIER_FUNCTIONS)}.")
    return [RlvrPrompt(p, a, verifier, prompt_ids(tokenizer, p)) for p, a in rows]
