"""A post-training stage's data, split in two that never meet: what the stage trains on, and what
its gate is judged on. The held-out part comes from the eval refs (a chat eval split, preference
rows, the verifiable eval suites as SFT examples); only when they hold nothing for the stage is it
split off the stage's own training data (`evals.hold_out`), which then trains without it."""

from dataclasses import dataclass

from contracts.manifest import DpoStage, SftStage
from domain.curriculum import PostPlan
from training.data import rows
from training.data.corpora import load_text, task_problems
from training.recipes.evals import hold_out
from training.recipes.posttrain import TokenExample, TokenPair
from training.recipes.run_data import Problems, RunData

PostData = tuple[Problems, list[TokenExample], list[TokenPair]]
"""A post-training stage's data: task problems (the byte path), token examples (SFT) or token
pairs (DPO)."""


@dataclass(frozen=True, slots=True)
class HeldOut:
    """What a post-training stage is judged on, none of it trained on: the SFT eval split
    (`examples`, response tokens learnt) and, for DPO, held-out preference pairs. `split`: held out
    of the stage's own training data (no eval split says otherwise), which then trains without them."""

    examples: list[TokenExample]
    pairs: list[TokenPair]
    split: bool


class PostSplits:
    """The post-training stages' data of one run, each stage's held-out part drawn once."""

    def __init__(self, data: RunData) -> None:
        self.data = data
        self._held: dict[str, HeldOut] = {}

    def trained_on(self, stage: PostPlan) -> PostData:
        """What the stage trains on: all of its data, less the part held out of it for its gate."""
        problems, examples, pairs = self.all_of(stage)
        if self.held_out(stage).split:
            return hold_out(problems)[0], hold_out(examples)[0], hold_out(pairs)[0]
        return problems, examples, pairs

    def all_of(self, stage: PostPlan) -> PostData:
        """A post-training stage's training data, all of it."""
        data = self.data
        structured = [name for name in stage.data if name in data.structured]
        problems = [
            p
            for name in stage.data
            if name not in data.structured
            for p in task_problems(load_text(data.sources[name], seed=data.seed))
        ]
        examples: list[TokenExample] = []
        pairs: list[TokenPair] = []
        if problems and data.tokenizer.id != "bytes":  # task lines through the run's real tokenizer
            examples, pairs = data.task_tokens(stage, problems)
            problems = []
        if structured:
            table = [r for name in structured for r in data.rows(name)]
            if isinstance(stage.section, SftStage):
                examples = rows.sft_examples(data.tokenizer, table)
            elif isinstance(stage.section, DpoStage):
                pairs = rows.dpo_pairs(data.tokenizer, table)
            else:
                raise ValueError(f"{stage.name} does not train on JSONL or Parquet rows yet.")
        return problems, examples, pairs

    def held_out(self, stage: PostPlan) -> HeldOut:
        """The stage's held-out data: the eval refs' (a chat eval split or the verifiable eval
        suites as SFT examples; preference rows as pairs), else a split of the stage's own
        training data (SFT: examples; DPO: pairs, drawn like its training pairs)."""
        if stage.name in self._held:
            return self._held[stage.name]
        data = self.data
        chat_eval = [name for name in data.eval_refs if name in data.structured]
        table = [r for name in chat_eval for r in data.rows(name)[: rows.EVAL_ROWS]]
        tasks = data.problems(stage.gate.task_samples)
        examples = rows.sft_examples(data.tokenizer, [r for r in table if "messages" in r])
        if not examples and tasks:
            examples = data.task_tokens(stage, tasks, sft=True)[0]
        pairs: list[TokenPair] = []
        split = False
        is_dpo = isinstance(stage.section, DpoStage)
        if is_dpo:
            pairs = rows.dpo_pairs(data.tokenizer, [r for r in table if "chosen" in r])
        if (isinstance(stage.section, SftStage) and not examples) or (is_dpo and not pairs):
            problems, own_examples, own_pairs = self.all_of(stage)
            held_problems = hold_out(problems)[1]
            if isinstance(stage.section, SftStage):
                examples = data.task_tokens(stage, held_problems, sft=True)[0] + hold_out(own_examples)[1]
            else:
                pairs = data.task_tokens(stage, held_problems, sft=False)[1] + hold_out(own_pairs)[1]
            split = True
        if is_dpo and not examples:  # the SFT objective on the held-out pairs' chosen answers
            examples = [(p + c, [0] * len(p) + [1] * len(c)) for p, c, _ in pairs]
        held = HeldOut(examples=examples, pairs=pairs, split=split)
        self._held[stage.name] = held
        return held
