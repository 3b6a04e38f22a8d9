"""`ecc ito sample`'s decoding (services/trainer/sampling.generate: the KV-cache decoder of
training/recipes/generation.py) against transformers' `generate` on the same model (issue 40).

Two shapes, both Llama: `tiny` (the 2-layer HF-format model of examples/finetune_assets.py, as
bench/hf_compare.py builds it) and `small` (d256, 4 layers, the shape issue 40 measured). Each is
written once as an HF directory; `generate` runs on `LlamaForCausalLM.from_pretrained` of it, ours
on its weights read through hf_adapter.from_hf: the same weights. Greedy, the same prompt, every
token generated (no end-of-sequence stop on either side), fp32, one torch thread (as issue 40
measured it: the trainer samples on its CPU beside other work; `--threads` changes it). The
figures say whether both sides produce the same tokens (`same_tokens`); `rate` is transformers'
time over ours (above 1: ours is faster). Alternating runs, the median of each side.
"""

import json
import pathlib
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench import stats

PROMPT_TOKENS = 32  # a short prompt, as `ecc ito sample` sends
THREADS = 1  # issue 40's figures were one thread; a whole-machine figure would measure the scheduler
SEED = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Sizes:
    new_tokens: int
    """Tokens generated per call."""
    repeats: int
    """Timed calls per side (alternating)."""
    threads: int = THREADS
    """torch threads while timing (0: the process's)."""


def _write_small(directory: pathlib.Path) -> None:
    """A d256, 4-layer Llama (grouped-query heads) with the tiny base's vocabulary size."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(SEED)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)


def _write_tiny(directory: pathlib.Path) -> None:
    from bench.hf_compare import _finetune_assets

    _finetune_assets().write_base_model(directory, "llama", seed=SEED)


def _ours(directory: pathlib.Path):
    from safetensors.torch import load_file

    from domain.model_shapes import shape_from_hf_config
    from training.model import Transformer
    from training.weights.hf_adapter import from_hf

    shape = shape_from_hf_config(json.loads((directory / "config.json").read_text())).shape
    model = Transformer(shape)
    model.load_state_dict(from_hf(load_file(str(directory / "model.safetensors")), shape))
    return model.eval()


def _hf(directory: pathlib.Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def compare(write: Callable[[pathlib.Path], None], sizes: Sizes) -> dict:
    from services.trainer.sampling import generate

    with tempfile.TemporaryDirectory(prefix="ito-bench-sample-") as root:
        directory = pathlib.Path(root) / "model"
        write(directory)
        ours_model, hf_model = _ours(directory), _hf(directory)
    vocab = ours_model.shape.vocab_size
    prompt = torch.randint(0, vocab, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(SEED)).tolist()
    n = sizes.new_tokens

    def ours() -> list[int]:
        return generate(
            ours_model,
            prompt,
            max_new_tokens=n,
            temperature=0,
            seed=0,
            eos_id=None,
            deadline=time.monotonic() + 600,
        )

    def hf() -> list[int]:
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=n,
                min_new_tokens=n,  # every token, as ours (no end-of-sequence stop)
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
            )
        return out[0, len(prompt) :].tolist()

    threads = torch.get_num_threads()
    torch.set_num_threads(sizes.threads or threads)
    try:
        tokens = {"ours": ours(), "generate": hf()}  # also the warm-up
        times: dict[str, list[float]] = {"ours": [], "generate": []}
        for repeat in range(sizes.repeats):
            for side in ("ours", "generate") if repeat % 2 == 0 else ("generate", "ours"):
                started = time.perf_counter()
                (ours if side == "ours" else hf)()
                times[side].append(time.perf_counter() - started)
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    ours_s, hf_s = stats.median(times["ours"]), stats.median(times["generate"])
    shape = ours_model.shape
    return {
        "what": f"greedy, {PROMPT_TOKENS}-token prompt, {n} new tokens, d{shape.d_model} x {shape.n_layer} layers",
        "ours_ms": round(ours_s * 1000, 2),
        "generate_ms": round(hf_s * 1000, 2),
        "ours_tokens_per_s": round(n / ours_s, 1),
        "rate": round(hf_s / ours_s, 3),
        "same_tokens": tokens["ours"] == tokens["generate"],
        "torch_threads": used,
        "repeats": sizes.repeats,
    }


BENCHMARKS: dict[str, Callable[[pathlib.Path], None]] = {
    "sample_tiny": _write_tiny,
    "sample_small": _write_small,
}


def run_all(sizes: Sizes, only: list[str] | None = None) -> dict[str, dict]:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    return {name: compare(write, sizes) for name, write in BENCHMARKS.items() if only is None or name in only}


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.sample_compare [--threads 1] [--new-tokens 64]`: these figures alone."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.sample_compare", description=main.__doc__)
    parser.add_argument("--only", default=",".join(BENCHMARKS))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--threads", type=int, default=THREADS, help="0: the process's")
    args = parser.parse_args(argv)
    only = [n.strip() for n in args.only.split(",") if n.strip()]
    sizes = Sizes(new_tokens=args.new_tokens, repeats=args.repeats, threads=args.threads)
    print(json.dumps(run_all(sizes, only), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
