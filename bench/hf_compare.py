"""Our training plane side by side with the Hugging Face stack, in one run, on the same tiny
HF-format model and data (examples/finetune_assets.py: a 2-layer Llama, its BPE tokenizer with a
ChatML template, `messages` and `prompt`/`chosen`/`rejected` chat JSONL):

- SFT: `posttrain.train_sft` on the chat rows rendered by our tokenizer's chat template (loss on the
  assistant's tokens) against `trl.SFTTrainer` (`assistant_only_loss=True`) on the same rows.
- DPO: `posttrain.train_dpo` on the preference rows against `trl.DPOTrainer`. Ours computes the
  frozen reference's log-probabilities ahead of the steps (`posttrain.ReferenceLogprobs`, in chunks
  of many batches, inside the first, warm-up, step); TRL's equivalent is
  `precompute_ref_log_probs=True` (a pass over the data before training). Both sides' timed steps
  then hold the policy's forward, backward and update only: the fair comparison. With TRL's default
  (a reference forward inside every step) TRL would do more work per step than ours.
- Data prep + tokenization: the JSONL `text` column of a generated corpus tokenized and written as
  a uint16 token file, against `datasets.load_dataset("json")` + `.map(tokenize, batched=True)` with
  `PreTrainedTokenizerFast` over the same tokenizer.json (its Arrow cache in a temporary dir).
- Export: the trained weights written as a Hugging Face directory, against transformers'
  `save_pretrained` of the same weights.

Same work on both sides: the same starting weights, the same batches in the same order (TRL's
dataset is the rows ours draws, step after step, read with the sequential sampler), the same batch
size, maximum length, learning rate, AdamW betas and gradient clipping, fp32 (bf16/fp16 off), no
gradient checkpointing, no evaluation, no saving, no reporting, no dataloader workers, and the torch
threads of this one process. Ours starts from the base's HF directory (`PostConfig.init_from`, read
by checkpoint_load.load_weights through hf_load), TRL from `from_pretrained` of it. The figures say
whether the token ids agree (`same_tokens`) and whether the first step's losses do
(`same_first_loss`: same weights, same batch, same loss).

Timing is as in bench/trainer_steps.py: a step ends when its end-of-step hook runs (our loop's
"metrics" emit; a TrainerCallback's `on_step_end` for TRL); the durations after warm-up steps, over
alternating short runs of each side, give each side's median step time.
"""

import json
import pathlib
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bench import stats
from bench.trainer_steps import _step_times, _timed

BATCH = 8  # SFT rows per step; DPO pairs per step (16 sequences)
MAX_LEN = 256  # the tiny base's max_position_embeddings; the chat rows are far shorter
SFT_LR, DPO_LR, DPO_BETA = 1e-4, 1e-5, 0.1
ASSET_ROWS = 400  # rows of sft.jsonl / dpo.jsonl (examples/finetune_assets.write_chat_data)
SEED = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Sizes:
    steps: int
    """Timed steps per repeat."""
    warmup: int
    repeats: int
    corpus_rows: int
    """Rows of the generated JSONL corpus the tokenization figures read."""
    export_repeats: int


# --- the assets both sides read ----------------------------------------------------------------


@dataclass(slots=True)
class Assets:
    root: pathlib.Path
    base: pathlib.Path
    sft: pathlib.Path
    dpo: pathlib.Path


def _finetune_assets() -> Any:
    import importlib.util

    path = pathlib.Path(__file__).resolve().parent.parent / "examples" / "finetune_assets.py"
    spec = importlib.util.spec_from_file_location("finetune_assets", path)
    assert spec and spec.loader, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_assets(root: pathlib.Path) -> Assets:
    assets = _finetune_assets()
    assets.write_base_model(root / "base", "llama", seed=SEED)
    files = assets.write_chat_data(root, rows=ASSET_ROWS, seed=SEED)
    return Assets(root=root, base=root / "base", sft=files["sft"], dpo=files["dpo"])


def _shape(base: pathlib.Path):
    from domain.model_shapes import shape_from_hf_config

    return shape_from_hf_config(json.loads((base / "config.json").read_text())).shape


def _read_jsonl(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _optional(module: str) -> Any:
    """A trainer module another part of issue 25 adds (the HF exporter), or None
    while it is not there: the bench then does the same work itself and says so in its figures."""
    import importlib
    import importlib.util

    return importlib.import_module(module) if importlib.util.find_spec(module) else None


def _hf_model(assets: Assets):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(assets.base, dtype=torch.float32)


def _hf_tokenizer(assets: Assets):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(assets.base)


# --- alternating runs, median step time ----------------------------------------------------------


Side = Callable[[], tuple[list[float], float]]


def _compare(ours: Side, trl: Side, sizes: Sizes) -> dict:
    durations: dict[str, list[float]] = {"ours": [], "trl": []}
    first: dict[str, float] = {}
    for repeat in range(sizes.repeats):
        order: tuple[tuple[str, Side], ...] = (("ours", ours), ("trl", trl))
        for name, side in order if repeat % 2 == 0 else order[::-1]:
            times, first_loss = side()
            durations[name] += _step_times(times, sizes.warmup)
            first[name] = first_loss
    ours_s, trl_s = stats.median(durations["ours"]), stats.median(durations["trl"])
    return {
        "ours_step_ms": stats.ms(ours_s),
        "trl_step_ms": stats.ms(trl_s),
        "ours_steps_per_s": round(1.0 / ours_s, 2),
        "trl_steps_per_s": round(1.0 / trl_s, 2),
        "rate": round(trl_s / ours_s, 3),  # >= 1.0: ours is no slower
        "ours_p90_step_ms": stats.ms(stats.percentile(durations["ours"], 90)),
        "trl_p90_step_ms": stats.ms(stats.percentile(durations["trl"], 90)),
        "ours_first_loss": round(first["ours"], 5),
        "trl_first_loss": round(first["trl"], 5),
        "steps": sizes.steps,
        "warmup_steps": sizes.warmup,
        "repeats": sizes.repeats,
        "batch": BATCH,
        "torch_threads": torch.get_num_threads(),
    }


def _step_clock(times: list[float], first_loss: list[float]):
    """A TrainerCallback noting when each optimizer step ends, and the first logged loss."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs and not first_loss:
                first_loss.append(float(logs["loss"]))

    return StepClock()


def _quiet(trainer) -> None:
    """No log lines on stdout (disable_tqdm swaps the progress bar for a printer of every log)."""
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)


def _hf_common(directory: str, total: int, lr: float) -> dict:
    """The TrainingArguments both TRL trainers get: our loop's settings, nothing else running."""
    return dict(
        output_dir=directory,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=1,
        max_steps=total,
        learning_rate=lr,
        adam_beta1=0.9,
        adam_beta2=0.95,  # ours: AdamW(betas=(0.9, 0.95), weight_decay=0)
        weight_decay=0.0,
        max_grad_norm=1.0,
        warmup_steps=0,
        lr_scheduler_type="constant",
        max_length=MAX_LEN,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="steps",
        logging_first_step=True,
        logging_steps=total + 1,  # only the first step's loss (the same-start check)
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        train_sampling_strategy="sequential",  # our draw order, below
        disable_tqdm=True,
        seed=SEED,
        data_seed=SEED,
    )


def _drawn(stage: str, n: int, total: int) -> list[int]:
    """The row indices our stage draws, step after step (posttrain.batch_rng): TRL reads the rows in
    this order, so both sides train on the same batches."""
    from training.recipes.posttrain import batch_rng

    order = []
    indices = list(range(n))
    for step in range(total):
        rng = batch_rng(SEED, stage, step)
        order += [rng.choice(indices) for _ in range(BATCH)]
    return order


def _post_config(stage: str, shape, init_from: str, total: int, directory: str, pad_id: int, **kw):
    from training.recipes.posttrain import PostConfig

    return PostConfig(
        stage=stage,
        shape=shape,
        rope_base=None,
        problems=[],
        steps=total,
        batch_size=BATCH,
        learning_rate=SFT_LR if stage == "sft" else DPO_LR,
        seed=SEED,
        checkpoint_dir=directory,
        checkpoint_interval=total,
        init_from=init_from,
        pad_id=pad_id,
        device="cpu",
        **kw,
    )


# --- SFT ----------------------------------------------------------------------------------------


def sft(assets: Assets, sizes: Sizes) -> dict:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from training.data import rows
    from training.data.tokenizer import HfTokenizer
    from training.recipes import posttrain

    total = sizes.warmup + sizes.steps
    shape = _shape(assets.base)
    init_from = str(assets.base)  # checkpoint_load.load_weights reads the HF directory (hf_load)
    tok = HfTokenizer.from_dir(assets.base)
    table = _read_jsonl(assets.sft)
    examples = rows.sft_examples(tok, table)
    assert len(examples) == len(table), "every chat row has an assistant turn"
    order = _drawn("sft", len(examples), total)
    dataset = Dataset.from_list([{"messages": rows.messages_of(table[i])} for i in order])
    hf_tok = _hf_tokenizer(assets)

    def ours() -> tuple[list[float], float]:
        times: list[float] = []
        losses: list[float] = []
        with tempfile.TemporaryDirectory(prefix="ito-bench-sft-") as directory:
            cfg = _post_config("sft", shape, init_from, total, directory, tok.pad_id, examples=examples)
            posttrain.train_sft(cfg, _timed(times, losses), lambda: False)
        return times, losses[0]

    prepared: list[Any] = []

    def trl() -> tuple[list[float], float]:
        times: list[float] = []
        first: list[float] = []
        with tempfile.TemporaryDirectory(prefix="ito-bench-trl-sft-") as directory:
            args = SFTConfig(**_hf_common(directory, total, SFT_LR), assistant_only_loss=True)
            trainer = SFTTrainer(
                model=_hf_model(assets),
                args=args,
                train_dataset=dataset,
                processing_class=hf_tok,
                callbacks=[_step_clock(times, first)],
            )
            _quiet(trainer)
            prepared[:] = [trainer.train_dataset]
            trainer.train()
        return times, first[0]

    figures = _compare(ours, trl, sizes)
    theirs = prepared[0]
    # TRL's prepared rows: input_ids, and labels that are -100 off the assistant's tokens.
    same = all(
        list(theirs[k]["input_ids"]) == examples[i][0]
        and [int(t != -100) for t in theirs[k]["labels"]] == examples[i][1]
        for k, i in enumerate(order)
    )
    return {
        "what": f"posttrain.train_sft vs trl.SFTTrainer(assistant_only_loss), {BATCH} chat rows a step, "
        "tiny HF Llama base",
        **figures,
        "same_tokens": same,
        # Same weights and the same first batch: the first losses agree.
        "same_first_loss": abs(figures["ours_first_loss"] - figures["trl_first_loss"]) < 1e-4,
    }


# --- DPO ----------------------------------------------------------------------------------------


def dpo(assets: Assets, sizes: Sizes) -> dict:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from training.data import rows
    from training.data.tokenizer import HfTokenizer
    from training.recipes import posttrain

    total = sizes.warmup + sizes.steps
    shape = _shape(assets.base)
    init_from = str(assets.base)  # checkpoint_load.load_weights reads the HF directory (hf_load)
    tok = HfTokenizer.from_dir(assets.base)
    table = _read_jsonl(assets.dpo)
    pairs = rows.dpo_pairs(tok, table)
    order = _drawn("dpo", len(pairs), total)
    # The prompt as our pairs have it (a user turn and the template's generation prompt), rendered
    # to text: TRL then appends eos to each completion and tokenizes, giving the same ids as ours.
    prompts = [tok.render([{"role": "user", "content": str(r["prompt"])}], True) for r in table]
    dataset = Dataset.from_list(
        [
            {"prompt": prompts[i], "chosen": table[i]["chosen"], "rejected": table[i]["rejected"]}
            for i in order
        ]
    )
    hf_tok = _hf_tokenizer(assets)

    def ours() -> tuple[list[float], float]:
        times: list[float] = []
        losses: list[float] = []
        with tempfile.TemporaryDirectory(prefix="ito-bench-dpo-") as directory:
            cfg = _post_config(
                "dpo", shape, init_from, total, directory, tok.pad_id, pairs=pairs, beta=DPO_BETA
            )
            posttrain.train_dpo(cfg, _timed(times, losses), lambda: False)
        return times, losses[0]

    prepared: list[Any] = []

    def trl() -> tuple[list[float], float]:
        times: list[float] = []
        first: list[float] = []
        with tempfile.TemporaryDirectory(prefix="ito-bench-trl-dpo-") as directory:
            args = DPOConfig(
                **_hf_common(directory, total, DPO_LR),
                beta=DPO_BETA,
                loss_type=["sigmoid"],
                precompute_ref_log_probs=True,  # ours: reference log-probs computed ahead (see above)
                precompute_ref_batch_size=64,
            )
            trainer = DPOTrainer(
                model=_hf_model(assets),
                args=args,
                train_dataset=dataset,
                processing_class=hf_tok,
                callbacks=[_step_clock(times, first)],
            )
            _quiet(trainer)
            prepared[:] = [trainer.train_dataset]
            trainer.train()
        return times, first[0]

    figures = _compare(ours, trl, sizes)
    theirs = prepared[0]
    same = all(
        (list(theirs[k]["prompt_ids"]), list(theirs[k]["chosen_ids"]), list(theirs[k]["rejected_ids"]))
        == (pairs[i][0], pairs[i][1], pairs[i][2])
        for k, i in enumerate(order)
    )
    return {
        "what": f"posttrain.train_dpo vs trl.DPOTrainer(precompute_ref_log_probs), {BATCH} pairs a step, "
        "tiny HF Llama base",
        **figures,
        "same_tokens": same,
        # Same weights and the same first batch: the first losses agree.
        "same_first_loss": abs(figures["ours_first_loss"] - figures["trl_first_loss"]) < 1e-4,
        "reference": "computed ahead on both sides (ours: ReferenceLogprobs chunks; TRL: precompute_ref_log_probs)",
    }


# --- data prep + tokenization -------------------------------------------------------------------


def write_corpus(path: pathlib.Path, rows: int) -> int:
    """A JSONL `text` corpus of `rows` documents: paragraphs of Python's pydoc topics (shipped with
    Python) and short arithmetic lines, cycled. Returns its size in bytes."""
    from pydoc_data.topics import topics

    paragraphs = [p.strip() for text in topics.values() for p in text.split("\n\n") if p.strip()]
    with path.open("w", encoding="utf-8") as f:
        for i in range(rows):
            text = paragraphs[i % len(paragraphs)] if i % 4 else f"{i % 97}+{i % 89}={i % 97 + i % 89}"
            f.write(json.dumps({"text": text}) + "\n")
    return path.stat().st_size


def _ours_tokenize(corpus: pathlib.Path, base: pathlib.Path, out: pathlib.Path) -> tuple[int, int]:
    """Data prep's path (training/data/token_files.py): the JSONL's text column streamed,
    tokenized with the base's tokenizer (eos after each document) into sharded, memory-mapped
    uint16 token files: (rows, tokens)."""
    from contracts.manifest import DataFormat
    from training.data.token_files import iter_column_documents, write_token_files
    from training.data.tokenizer import HfTokenizer

    tok = HfTokenizer.from_dir(base)
    documents = iter_column_documents(corpus, DataFormat.jsonl)
    index = write_token_files(out, documents, tok, sources={"corpus": "bench"})
    return index.documents, index.tokens


def _datasets_tokenize(corpus: pathlib.Path, base: pathlib.Path, cache: pathlib.Path) -> tuple[int, int]:
    """`datasets.load_dataset("json")` + `.map(tokenize, batched=True)` with the same tokenizer
    (eos after each document, as ours), its Arrow cache in `cache`: (rows, tokens)."""
    import datasets
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(base)
    eos = tok.eos_token_id

    def tokenize(batch):
        ids = tok(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [[*doc, eos] for doc in ids]}

    ds = datasets.load_dataset("json", data_files=str(corpus), split="train", cache_dir=str(cache))
    ds = ds.map(tokenize, batched=True, remove_columns=["text"])
    lengths = ds.with_format("arrow")["input_ids"]
    import pyarrow.compute as pc

    return len(ds), int(pc.sum(pc.list_value_length(lengths)).as_py())


def tokenization(assets: Assets, sizes: Sizes) -> dict:
    import datasets

    datasets.disable_progress_bars()
    corpus = assets.root / "corpus.jsonl"
    size = write_corpus(corpus, sizes.corpus_rows)
    times: dict[str, list[float]] = {"ours": [], "datasets": []}
    counts: dict[str, tuple[int, int]] = {}
    for repeat in range(max(1, sizes.repeats // 2)):
        sides = ("ours", "datasets") if repeat % 2 == 0 else ("datasets", "ours")
        for side in sides:
            with tempfile.TemporaryDirectory(prefix="ito-bench-tok-", dir=assets.root) as directory:
                started = time.perf_counter()
                if side == "ours":
                    counts[side] = _ours_tokenize(corpus, assets.base, pathlib.Path(directory) / "tokens")
                else:
                    counts[side] = _datasets_tokenize(corpus, assets.base, pathlib.Path(directory))
                times[side].append(time.perf_counter() - started)
    ours_s, theirs_s = stats.median(times["ours"]), stats.median(times["datasets"])
    rows, tokens = counts["ours"]
    return {
        "what": f"{rows:,} JSONL text rows -> uint16 token files, vs datasets.load_dataset('json').map(batched)",
        "rows": rows,
        "tokens": tokens,
        "corpus_bytes": size,
        "ours_s": round(ours_s, 3),
        "datasets_s": round(theirs_s, 3),
        "ours_rows_per_s": round(rows / ours_s),
        "datasets_rows_per_s": round(counts["datasets"][0] / theirs_s),
        "ours_tokens_per_s": round(tokens / ours_s),
        "datasets_tokens_per_s": round(counts["datasets"][1] / theirs_s),
        "rate": round(theirs_s / ours_s, 3),
        "same_token_count": counts["ours"] == counts["datasets"],
        "ours_impl": "token_files.write_token_files(iter_column_documents)",
    }


# --- export -------------------------------------------------------------------------------------


def _ours_export(state: dict[str, torch.Tensor], shape, base: pathlib.Path, out: pathlib.Path) -> str:
    """services/trainer/hf_export.write_hf_export when it is there; until then the same files
    written here (HF names, one safetensors file, config.json from hf_config_from_shape, the
    tokenizer files). Returns which ran."""
    from training.data.tokenizer import tokenizer_files

    files = tokenizer_files(base)
    hf_export = _optional("training.weights.hf_export")
    if hf_export is not None:
        hf_export.write_hf_export(state, shape, out, tokenizer_files=files)
        return "hf_export.write_hf_export"
    from safetensors.torch import save_file

    from domain.model_shapes import hf_config_from_shape
    from training.weights.hf_adapter import to_hf

    hf = {k: v.contiguous() for k, v in to_hf(state, shape).items()}
    out.mkdir(parents=True)
    save_file(hf, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config_from_shape(shape, family="llama"), indent=2))
    for name, data in files.items():
        (out / name).write_bytes(data)
    return "bench stand-in (safetensors.save_file + config.json; hf_export.py not on main yet)"


def export(assets: Assets, sizes: Sizes) -> dict:
    from safetensors.torch import load_file

    from training.weights.hf_adapter import from_hf

    shape = _shape(assets.base)
    state = from_hf(load_file(str(assets.base / "model.safetensors")), shape)
    model = _hf_model(assets)
    hf_tok = _hf_tokenizer(assets)
    times: dict[str, list[float]] = {"ours": [], "save_pretrained": []}
    impl = ""
    for repeat in range(sizes.export_repeats):
        sides = ("ours", "save_pretrained") if repeat % 2 == 0 else ("save_pretrained", "ours")
        for side in sides:
            with tempfile.TemporaryDirectory(prefix="ito-bench-export-", dir=assets.root) as directory:
                out = pathlib.Path(directory) / "export"
                started = time.perf_counter()
                if side == "ours":
                    impl = _ours_export(state, shape, assets.base, out)
                else:
                    model.save_pretrained(out, safe_serialization=True)
                    hf_tok.save_pretrained(out)
                times[side].append(time.perf_counter() - started)
                if repeat == 0 and side == "ours":
                    size = sum(p.stat().st_size for p in out.iterdir())
    ours_s, theirs_s = stats.median(times["ours"]), stats.median(times["save_pretrained"])
    return {
        "what": "the tiny model's weights + tokenizer as an HF directory, vs save_pretrained (model + tokenizer)",
        "ours_s": round(ours_s, 4),
        "save_pretrained_s": round(theirs_s, 4),
        "rate": round(theirs_s / ours_s, 3),
        "export_bytes": size,
        "repeats": sizes.export_repeats,
        "ours_impl": impl,
    }


# --- all of them --------------------------------------------------------------------------------

BENCHMARKS: dict[str, Callable[[Assets, Sizes], dict]] = {
    "hf_sft": sft,
    "hf_dpo": dpo,
    "hf_tokenize": tokenization,
    "hf_export": export,
}


def run_all(sizes: Sizes, only: list[str] | None = None) -> dict[str, dict]:
    import os

    import datasets
    import transformers

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")  # both sides' tokenizers alike
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    results = {}
    with tempfile.TemporaryDirectory(prefix="ito-bench-hf-") as root:
        assets = write_assets(pathlib.Path(root))
        for name, bench in BENCHMARKS.items():
            if only is None or name in only:
                results[name] = bench(assets, sizes)
    return results


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.hf_compare [--only hf_sft,hf_dpo] [--steps N]`: these figures alone."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.hf_compare", description=main.__doc__)
    parser.add_argument("--only", default=",".join(BENCHMARKS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--corpus-rows", type=int, default=30_000)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = Sizes(
        steps=args.steps,
        warmup=args.warmup,
        repeats=args.repeats,
        corpus_rows=args.corpus_rows,
        export_repeats=5,
    )
    only = [n.strip() for n in args.only.split(",") if n.strip()]
    print(json.dumps(run_all(sizes, only), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
