"""The run's data as its stages read it: each ref's source (the raw one, or the prepared file once
data preparation ran), its format and rows, the run's tokenizer, the token files a next-token stage
memory-maps, and the verifiable tasks of the eval suites, as text or as token examples and pairs.

One `RunData` per run; data preparation repoints `sources` at the prepared files, and everything
after it reads them."""

import functools
import itertools
import pathlib
import random

from contracts.manifest import DataFormat, DataRef, Manifest, SftStage
from domain.curriculum import Curriculum, PostPlan
from runtime.storage import data_files
from training.data import rows
from training.data.corpora import load_eval_suite
from training.data.token_files import iter_source_documents, write_token_files
from training.data.tokenizer import Tokenizer, load_tokenizer
from training.recipes.evals import task_suite
from training.recipes.posttrain import TokenExample, TokenPair, wrong_answer
from training.recipes.pretrain import TOKENS_SOURCE

Problems = list[tuple[str, str]]  # verifiable tasks: (prompt, answer)


class RunData:
    """The data refs of one run and what its stages read of them."""

    def __init__(
        self,
        manifest: Manifest,
        plan: Curriculum,
        root: pathlib.Path,
        *,
        base_dir: pathlib.Path | None = None,
        store_root: pathlib.Path | None = None,
    ) -> None:
        self.manifest, self.root, self.seed = manifest, root, manifest.seed
        self.base_dir = base_dir  # a base model's HF directory: its tokenizer, when the manifest names none
        self.store_root = store_root  # the model store (tokenizer entries by digest)
        self.train_refs, self.eval_refs = dict(plan.train_refs), dict(plan.eval_refs)
        self.sources = dict(plan.train_refs)  # ref name -> what to load: raw source, or the prepared file
        self.refs = {ref.name: ref for ref in manifest.data}
        self.structured = {ref.name for ref in manifest.data if rows.is_structured(ref)}  # JSONL / Parquet
        # Text eval suites (generated, builtin, text files): the held-out text of the LM batteries.
        self.eval_sources = [src for name, src in plan.eval_refs.items() if name not in self.structured]

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The run's tokenizer: the manifest's, else the base model's, else bytes."""
        return load_tokenizer(self.manifest.model.tokenizer, self.base_dir, self.store_root)

    def tokenized(self, names: tuple[str, ...]) -> bool:
        """Whether a next-token stage reads token files: anything but the byte tokenizer on raw
        sources (the tiny demo's path, where a source is its bytes)."""
        return self.tokenizer.id != "bytes" or any(n in self.structured for n in names)

    def token_files(self, key: str, names: tuple[str, ...]) -> str:
        """`names`' documents tokenized once into `<run>/tokens/<key>/` (reused when complete for the
        same tokenizer and inputs): a `tokens:` source the stage memory-maps."""
        fmt = {n: self.format(n) for n in names}
        documents = itertools.chain.from_iterable(
            iter_source_documents(self.sources[n], fmt[n], seed=self.seed) for n in names
        )
        inputs = {n: self.refs[n].digest or self.sources[n] for n in names}
        directory = self.root / "tokens" / key
        write_token_files(directory, documents, self.tokenizer, sources=inputs)
        return f"{TOKENS_SOURCE}{directory}"

    def eval_token_files(self) -> str:
        """The text eval suites (the same documents the byte path reads), tokenized once."""
        names = [n for n in self.eval_refs if n not in self.structured]
        documents = itertools.chain.from_iterable(
            load_eval_suite(self.eval_refs[n], seed=self.seed) for n in names
        )
        directory = self.root / "tokens" / "eval"
        write_token_files(directory, documents, self.tokenizer, sources={n: self.eval_refs[n] for n in names})
        return f"{TOKENS_SOURCE}{directory}"

    def structured_eval_texts(self, name: str) -> list[str]:
        """An eval ref's split as documents: its first EVAL_ROWS rows' texts."""
        return [rows.row_text(r) for r in rows.read_rows(self.refs[name])[: rows.EVAL_ROWS]]

    def format(self, name: str) -> DataFormat:
        """The format of what a ref's stages read now: the prepared file's own (data prep writes a
        structured ref's surviving rows as JSONL, whatever it came in: issue 39, a Parquet corpus
        was then opened as Parquet), else the ref's."""
        source = self.sources.get(name, self.refs[name].source)
        if source != self.refs[name].source:
            return data_files.file_format(DataRef(name=name, source=source))
        return data_files.file_format(self.refs[name])

    def rows(self, name: str) -> list[rows.Row]:
        """A JSONL / Parquet ref's rows: the prepared file's once data prep ran, else the original."""
        source = self.sources.get(name, self.refs[name].source)
        return rows.read_rows(self.refs[name], source=source)

    def problems(self, limit: int) -> Problems:
        """The eval suites' verifiable tasks (at most `limit`): what the batteries' task accuracy asks."""
        return task_suite(self.eval_sources, seed=self.seed, limit=limit)

    def task_tokens(
        self, stage: PostPlan, problems: Problems, *, sft: bool | None = None
    ) -> tuple[list[TokenExample], list[TokenPair]]:
        """Verifiable tasks as the run's tokenizer encodes them: SFT examples (the answer and its
        newline learnt), or DPO pairs (the right answer against a nearby wrong one, drawn once per
        task from the run's seed). `sft`: which (default: the stage's kind)."""
        tok = self.tokenizer
        if sft if sft is not None else isinstance(stage.section, SftStage):
            out = []
            for prompt, answer in problems:
                p, a = tok.encode(prompt), tok.encode(answer + "\n")
                out.append((p + a, [0] * len(p) + [1] * len(a)))
            return out, []
        rng = random.Random(f"{stage.name}:{self.seed}:pairs")
        pairs = [
            (tok.encode(p), tok.encode(a + "\n"), tok.encode(wrong_answer(a, rng) + "\n"))
            for p, a in problems
        ]
        return [], pairs
