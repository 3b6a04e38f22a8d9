"""Sampling from a run's committed checkpoint: `ecc ito sample RUN --prompt ...`.

The trainer restores the stage's model (services/trainer/restore.py; the last one loaded is kept,
by run, stage and step, so a second prompt to the same checkpoint loads nothing), tokenizes the
prompt (`chat`: one user message rendered with the tokenizer's chat template and its generation
prompt), and generates with the KV-cache decoder (training/recipes/generation.py `decode`: the
prompt through the model once, then one position per token; several prompts in one batch, each at
its own length, give the tokens each would alone): greedy at temperature 0, else sampled with a
torch.Generator seeded by the request, so the same request gives the same text. It stops at the
tokenizer's end-of-sequence token, after `max_new_tokens` (the contract caps it at 512), or at the
deadline (SAMPLE_DEADLINE_S), and answers the completion alone; stopped by the deadline, the
answer has the tokens so far and says `truncated`. Sampling uses the trainer's CPU: one sample at
a time (the caller runs it in a worker thread under `Sampler`'s lock).
"""

import pathlib
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from contracts.errors import ErrorCode
from contracts.exports import SampleOrder, SampleRequest, SampleResult
from runtime.messaging.codec import Refusal
from services.trainer import restore
from services.trainer.restore import StageSource
from training.model import Transformer
from training.recipes.generation import decode

MAX_NEW_TOKENS = 512  # the contract's cap too (contracts/exports.py SampleRequest)
SAMPLE_DEADLINE_S = 50.0  # under the scheduler's call timeout (services/scheduler/peers.py)


@dataclass(frozen=True, slots=True)
class Loaded:
    key: tuple[str, str, int]  # (run, stage, step)
    model: Transformer
    tokenizer: Any


def prompt_ids(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    """The prompt's token ids; with `chat`, one user message in the tokenizer's chat template with
    the generation prompt (a tokenizer without a template refuses it)."""
    if not chat:
        return list(tokenizer.encode(prompt))
    render = getattr(tokenizer, "chat", None)  # training.data.tokenizer's: (ids, assistant mask)
    if render is None:
        raise Refusal(
            ErrorCode.request_invalid, "this run's tokenizer renders no chat; sample without --chat"
        )
    try:
        ids, _mask = render([{"role": "user", "content": prompt}], add_generation_prompt=True)
    except ValueError as exc:  # a tokenizer without a chat template says so
        raise Refusal(ErrorCode.request_invalid, f"{exc} Sample without --chat.") from None
    return list(ids)


@dataclass(frozen=True, slots=True)
class Generated:
    tokens: list[list[int]]  # new token ids per prompt, the end-of-sequence token left out
    truncated: bool  # the deadline stopped decoding before every prompt was done


def generate_batch(
    model: Transformer,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    eos_id: int | None,
    deadline: float,
) -> Generated:
    """New token ids after each prompt, decoded together with the KV cache: greedy at temperature
    0, else sampled with a generator seeded by `seed`; a prompt stops at `eos_id` (not included),
    after max_new_tokens; all stop at `deadline` (monotonic), with the tokens so far."""
    out = decode(
        model,
        prompts,
        max_new_tokens=min(max_new_tokens, MAX_NEW_TOKENS),
        temperature=temperature,
        generator=torch.Generator().manual_seed(seed),
        end_token=eos_id,
        deadline=deadline,
    )
    tokens = [c.tokens[:-1] if c.finished else c.tokens for c in out.completions]
    return Generated(tokens, out.truncated)


def generate(
    model: Transformer,
    ids: list[int],
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    eos_id: int | None,
    deadline: float,
) -> list[int]:
    """New token ids after `ids` (one prompt: `generate_batch`)."""
    one = generate_batch(
        model,
        [ids],
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        eos_id=eos_id,
        deadline=deadline,
    )
    return one.tokens[0]


class Sampler:
    """One sample at a time, the last loaded model kept."""

    def __init__(self, store_root: pathlib.Path, loader: restore.Loader = restore.restore_model) -> None:
        self.store_root = store_root  # the model store (Settings.model_store): base models, tokenizers
        self.loader = loader
        self.lock = threading.Lock()
        self._loaded: Loaded | None = None
        self.loads = 0  # how many times a model was restored (tests: the cache works)

    def _model(self, src: StageSource) -> Loaded:
        key = (src.run_id, src.stage.name, src.checkpoint.step)
        if self._loaded is not None and self._loaded.key == key:
            return self._loaded
        self._loaded = None  # the old one's memory goes before the new one is built
        model, info = self.loader(src, self.store_root)
        tokenizer = restore.load_run_tokenizer(src, self.store_root)
        self.loads += 1
        self._loaded = Loaded((src.run_id, src.stage.name, info.step), model, tokenizer)
        return self._loaded

    def sample(
        self, src: StageSource, req: SampleRequest, deadline_s: float = SAMPLE_DEADLINE_S
    ) -> SampleResult:
        """Blocking: run it in a worker thread. Waits for the sample before it (within the deadline)."""
        deadline = time.monotonic() + deadline_s
        if not self.lock.acquire(timeout=deadline_s):
            raise Refusal(ErrorCode.backend_unavailable, "the trainer is busy sampling; try again shortly")
        try:
            loaded = self._model(src)
            ids = prompt_ids(loaded.tokenizer, req.prompt, req.chat)
            if not ids:
                raise Refusal(ErrorCode.request_invalid, "the prompt encodes to no tokens")
            out = generate_batch(
                loaded.model,
                [ids],
                max_new_tokens=req.max_new_tokens,
                temperature=req.temperature,
                seed=req.seed,
                eos_id=restore.eos_id_of(loaded.tokenizer),
                deadline=deadline,
            )
            new = out.tokens[0]
            return SampleResult(
                run_id=src.run_id,
                stage=src.stage.name,
                step=loaded.key[2],
                text=loaded.tokenizer.decode(new),
                tokens=len(new),
                truncated=out.truncated,
            )
        finally:
            self.lock.release()


def answer_sample(sampler: Sampler, local_root: pathlib.Path, order: SampleOrder) -> SampleResult:
    """TRAINER_SAMPLE (blocking: the worker runs it in a thread)."""
    from services.trainer.exports import decode_manifest

    req = order.request
    run = restore.owned_run_dir(local_root, order.storage, order.account, order.run_id)
    src = restore.locate(run, order.run_id, decode_manifest(order.manifest_text), order.base, req.stage)
    return sampler.sample(src, req)
