"""The eval battery each stage runs when it ends, and the gate that judges it.

The battery is fixed per stage kind: held-out loss on the run's eval suites and exact-match
accuracy on its verifiable eval suites (greedy decoding) for every stage; long-context adds the
short-context loss (against the incoming model's) and synthetic needle retrieval. The manifest only
sets thresholds. `judge` is a pure function from measured values and thresholds to the eval event.
"""

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from contracts.evals import EvalMetric
from domain.gates import passes
from training.data.corpora import ByteTokenizer, load_eval_suite, needle_document, split_task_line
from training.data.tokenizer import Tokenizer
from training.model import Transformer
from training.recipes.generation import complete

T = TypeVar("T")
TASK_ANSWER_SLACK = 2  # decode a couple of tokens past the longest answer, so "47\n" vs "47\n" is fair


@dataclass(frozen=True, slots=True, kw_only=True)
class Check:
    """One metric of the battery and its threshold (None: reported, not gated)."""

    name: str
    value: float | None
    threshold: float | None = None
    op: str = ">="
    sentence: str = ""  # what the gate compares, in words (domain/gates.sentence)


OPS = (">=", ">", "<=", "<")
NOT = {">=": "<", ">": "<=", "<=": ">", "<": ">="}


def judge(checks: Sequence[Check]) -> tuple[list[EvalMetric], bool]:
    """An EvalMetric for each measured check, and whether the gate passed. Unmeasured checks
    without a threshold are left out; a gated one that cannot be measured is an error, never a pass."""
    metrics, passed = [], True
    for check in checks:
        if check.op not in OPS:
            raise ValueError(f"A gate compares with >=, >, <= or <, not {check.op!r}.")
        if check.value is None:
            if check.threshold is not None:  # the pipeline refuses such a gate before training
                raise ValueError(
                    f"The gate on {check.name} cannot be judged: there is nothing to measure it on."
                )
            continue
        ok = check.threshold is None or passes(check.value, check.op, check.threshold)
        passed &= ok
        metrics.append(
            EvalMetric(
                name=check.name,
                value=float(check.value),
                threshold=check.threshold,
                op=check.op,
                passed=ok,
                sentence=check.sentence,
            )
        )
    return metrics, passed


HOLD_OUT_EVERY = 10  # no eval split for a post-training stage: every tenth training row is held out


def hold_out(items: Sequence[T]) -> tuple[list[T], list[T]]:
    """(train, held_out) of a post-training stage's own rows when no eval split is given: every
    HOLD_OUT_EVERY-th row (the last of each ten), and at least the last row of two or more; the
    same split every call, so a resumed stage trains on what it started with."""
    n = len(items)
    if n < 2:
        return list(items), []
    held = {i for i in range(n) if i % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1} or {n - 1}
    return [x for i, x in enumerate(items) if i not in held], [items[i] for i in sorted(held)]


def describe(stage: str, metrics: list[EvalMetric]) -> str:
    """A one-line summary that states the numbers: "pretrain gate failed: held_out_loss 2.31 > 1.00"."""
    failed = [m for m in metrics if not m.passed]
    shown = failed or metrics
    parts = []
    for m in shown:
        if m.threshold is None:
            parts.append(f"{m.name} {m.value:.4f}")
        else:
            bad = NOT[m.op] if not m.passed else m.op
            parts.append(f"{m.name} {m.value:.4f} {bad} {m.threshold:.4f}")
    verdict = "gate failed" if failed else "gate passed"
    return f"{stage} {verdict}: " + ", ".join(parts) if parts else f"{stage} {verdict}"


def task_suite(eval_sources: Sequence[str], *, seed: int, limit: int) -> list[tuple[str, str]]:
    """Up to `limit` verifiable (prompt, answer) problems from the eval suites, round-robin across
    suites so each task is represented."""
    per_suite = []
    for source in eval_sources:
        if source.startswith("generated:"):
            problems = [
                p for doc in load_eval_suite(source, seed=seed) if (p := split_task_line(doc)) is not None
            ]
            if problems:
                per_suite.append(problems)
    mixed = [
        problems[i]
        for i in range(max((len(p) for p in per_suite), default=0))
        for problems in per_suite
        if i < len(problems)
    ]
    return mixed[:limit]


def task_accuracy(
    model: Transformer, problems: Sequence[tuple[str, str]], tokenizer: Tokenizer | None = None
) -> float | None:
    """Exact-match accuracy of greedy answers (the text before the first newline), the prompts
    encoded with the run's tokenizer (bytes by default)."""
    if not problems:
        return None
    tok: Tokenizer = tokenizer or ByteTokenizer()
    newline = tok.encode("\n")
    end = newline[-1] if len(newline) == 1 else tok.eos_id
    max_new = max(len(answer.encode()) for _, answer in problems) + TASK_ANSWER_SLACK
    completions = complete(
        model, [tok.encode(prompt) for prompt, _ in problems], max_new_tokens=max_new, end_token=end
    )
    right = sum(
        tok.decode(c.tokens).split("\n", 1)[0] == answer
        for c, (_, answer) in zip(completions, problems, strict=True)
    )
    return right / len(problems)


def needle_trials(count: int, context_bytes: int, seed: int) -> list[tuple[str, str]]:
    """(prompt, key) pairs, every prompt exactly `context_bytes` long (left-padded with spaces) so
    they decode as one batch; the key sits at a random depth."""
    rng = random.Random(f"needle-eval:{seed}")
    trials: list[tuple[str, str]] = []
    while len(trials) < count:
        context, query, key = needle_document(rng, context_bytes)
        prompt = context + query
        if len(prompt) <= context_bytes:
            trials.append((prompt.rjust(context_bytes), key))
    return trials


def needle_accuracy(model: Transformer, trials: Sequence[tuple[str, str]]) -> float | None:
    if not trials:
        return None
    tok = ByteTokenizer()
    completions = complete(
        model, [tok.encode(prompt) for prompt, _ in trials], max_new_tokens=len(trials[0][1])
    )
    return sum(tok.decode(c.tokens) == key for c, (_, key) in zip(completions, trials, strict=True)) / len(
        trials
    )


def preference(
    policy: torch.Tensor, reference: torch.Tensor, beta: float
) -> tuple[float | None, float | None]:
    """(preference accuracy, mean reward margin) of held-out pairs: `policy` and `reference` are
    (pairs, 2) summed log-probabilities of (chosen, rejected) under the trained and the incoming
    model; the implicit reward is beta x (policy - reference), as DPO trains it. A pair counts as
    right only when the chosen answer's reward is strictly higher (a tie is not a preference)."""
    if policy.numel() == 0:
        return None, None
    rewards = beta * (policy.double() - reference.double())
    margins = rewards[:, 0] - rewards[:, 1]
    return float((margins > 0).double().mean()), float(margins.mean())
