"""RLVR end to end on CPU: reward rises from an SFT warm start; stale rollouts are dropped and
counted; groups that are all right or all wrong are dropped and refilled, judged on correctness and
not on the shaped reward; the rollout worker is a real separate process."""

import pathlib

import pytest
import torch

from contracts.manifest import RlvrStage
from contracts.models import MODEL_SHAPES
from contracts.runs import LogLine, Metrics
from tests.support import THREADS
from training.data.corpora import load_text, task_problems
from training.engine.reporting import Recorder
from training.recipes.generation import Completion
from training.recipes.objectives import group_advantages
from training.recipes.posttrain import PostConfig, train_sft
from training.recipes.pretrain import StageConfig, train_stage
from training.recipes.rlvr import RlvrConfig, policy_batch, score, score_group, train_rlvr
from training.recipes.rollout import RolloutBatch

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
TINY = MODEL_SHAPES["tiny"]
SMALL = "generated:small_arithmetic"


def never() -> bool:
    return False


@pytest.fixture(scope="module")
def sft_checkpoint(tmp_path_factory) -> str:
    """A tiny model pretrained on single-digit arithmetic, then SFT'd on it: greedy answers are
    mostly right, sampled ones (temperature 1) about half the time, which leaves RL room to act."""
    root = tmp_path_factory.mktemp("warm")
    torch.set_num_threads(THREADS)
    pre = StageConfig(
        stage="pretrain",
        shape=TINY,
        train_sources=[SMALL],
        seq_len=32,
        batch_size=32,
        learning_rate=3e-3,
        steps=150,
        warmup_steps=8,
        seed=0,
        checkpoint_dir=str(root / "pretrain"),
        checkpoint_interval=1000,
    )
    train_stage(pre, Recorder(), never)
    problems = task_problems(load_text(SMALL))
    sft = PostConfig(
        stage="sft",
        shape=TINY,
        rope_base=None,
        problems=problems,
        steps=60,
        batch_size=32,
        learning_rate=1e-3,
        seed=0,
        checkpoint_dir=str(root / "sft"),
        checkpoint_interval=1000,
        init_from=str(root / "pretrain"),
    )
    train_sft(sft, Recorder(), never)
    return str(root / "sft")


def rl_config(
    tmp_path: pathlib.Path, init_from: str | None, problems, steps: int = 25, **section
) -> RlvrConfig:
    """`section`: RlvrStage fields over this test's own (L_max 8, L_cache 3)."""
    rlvr = RlvrStage(**({"max_response_tokens": 8, "overlong_buffer_tokens": 3} | section))
    return RlvrConfig(
        stage="rlvr",
        shape=TINY,
        rope_base=None,
        problems=problems,
        steps=steps,
        batch_size=rlvr.prompts_per_step * rlvr.group_size,
        learning_rate=3e-4,
        seed=0,
        checkpoint_dir=str(tmp_path / "rlvr"),
        checkpoint_interval=1000,
        init_from=init_from,
        rlvr=rlvr,
        threads=1,
    )


def test_verifiable_reward_rises_during_rlvr(sft_checkpoint, tmp_path):
    # Four problems, each sampled ~16 times a step: enough signal per problem for 25 steps to show.
    # Measured over seeds 0-3: mean accuracy of the first 5 steps ~0.40, of the last 5 ~0.78.
    problems = sorted(set(task_problems(load_text(SMALL))))[::50]
    emit = Recorder()
    result = train_rlvr(rl_config(tmp_path, sft_checkpoint, problems), emit, never)
    assert result.final_step == 25 and not result.stopped and result.stale_dropped == 0
    accuracy = [s.accuracy for s in result.stats]
    first, last = sum(accuracy[:5]) / 5, sum(accuracy[-5:]) / 5
    assert last > first + 0.15, f"accuracy per step: {[round(a, 2) for a in accuracy]}"
    # reward and KL travel as log lines; metrics carry the policy loss
    assert [m.step for m in emit.of(Metrics)] == list(range(1, 26))
    assert any("reward" in e.message and "kl" in e.message for e in emit.of(LogLine))


def completion(text: str, finished: bool = True) -> Completion:
    tokens = list(text.encode())
    return Completion(tokens=tokens, logprobs=[-1.0] * len(tokens), finished=finished)


def test_score_exact_answer_and_overlong_shaping():
    assert score(completion("47\n"), "47", max_tokens=8, buffer_tokens=3) == (1.0, True)
    assert score(completion("48\n"), "47", max_tokens=8, buffer_tokens=3) == (0.0, False)
    # 7 tokens: inside the buffer (free up to 5): (5 - 7) / 3
    assert score(completion("47    \n"), "47", max_tokens=8, buffer_tokens=3)[0] == pytest.approx(-2 / 3)
    assert score(completion("47474747", finished=False), "47", max_tokens=8, buffer_tokens=3) == (-1.0, False)


def test_a_group_is_scored_for_reward_and_for_correctness():
    cfg = rl_config(pathlib.Path("/tmp/unused"), None, [("1+2=", "3")])
    # L_max 8, L_cache 3: free up to 5 tokens; "xxxxx\n" is 6 long -> (5 - 6) / 3
    rewards, correct = score_group([completion("x\n")] * 7 + [completion("xxxxx\n")], "3", cfg)
    assert rewards.tolist() == pytest.approx([0.0] * 7 + [-1 / 3])
    assert correct.tolist() == [False] * 8


def test_policy_batch_masks_the_completion_tokens():
    inputs, targets, mask, old = policy_batch([[1, 2, 3], [4]], [completion("a\n"), completion("bc\n")])
    assert inputs.tolist() == [[1, 2, 3, 97], [4, 98, 99, 0]]  # right-padded with 0
    assert targets.tolist() == [[2, 3, 97, 10], [98, 99, 10, 0]]
    assert mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]  # the targets that are completion tokens
    assert old.tolist() == [[0, 0, -1, -1], [-1, -1, -1, 0]]


class FakeWorker:
    """Serves rollouts like the real worker, but every first-round request is answered from a
    policy `lag` versions old, and answers alternate right/wrong so no group is uniform."""

    lag = 2

    def __init__(self, shape, rope_base, *, threads, device):
        self.version = -1
        self.pending: dict[str, object] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def publish(self, version, state_dict):
        self.version = version

    def request(self, request):
        self.pending[request.request_id] = request

    def collect(self, request_id):
        request = self.pending.pop(request_id)
        version = self.version - self.lag if request_id.endswith(":0") else self.version
        groups = [
            [completion("3\n" if i % 2 else "x\n") for i in range(request.group_size)]
            for _ in request.prompts
        ]
        return RolloutBatch(request_id=request_id, version=version, prompts=request.prompts, groups=groups)


def test_rollouts_older_than_the_bound_are_dropped_and_counted(tmp_path):
    emit = Recorder()
    cfg = rl_config(tmp_path, None, [("1+2=", "3")], steps=3, prompts_per_step=2, group_size=4)
    result = train_rlvr(cfg, emit, never, worker_factory=FakeWorker)
    # Every step's first batch (2 prompts x 4) is 2 versions old at k = 1: dropped, then refilled.
    assert [s.stale_dropped for s in result.stats] == [8, 8, 8]
    assert result.stale_dropped == 24
    assert [s.groups_kept for s in result.stats] == [2, 2, 2] and [s.rounds for s in result.stats] == [
        2,
        2,
        2,
    ]
    assert any("dropped 24 stale rollouts" in e.message for e in emit.of(LogLine))


def test_within_the_bound_nothing_is_dropped(tmp_path):
    cfg = rl_config(
        tmp_path, None, [("1+2=", "3")], steps=2, prompts_per_step=2, group_size=4, max_staleness=2
    )
    result = train_rlvr(cfg, Recorder(), never, worker_factory=FakeWorker)
    assert result.stale_dropped == 0 and [s.rounds for s in result.stats] == [1, 1]


class UniformWorker(FakeWorker):
    """Fresh rollouts; round 0 groups are all right (uniform reward), later rounds mixed."""

    def collect(self, request_id):
        request = self.pending.pop(request_id)
        mixed = not request_id.endswith(":0")
        groups = [
            [completion("3\n" if (i % 2 or not mixed) else "x\n") for i in range(request.group_size)]
            for _ in request.prompts
        ]
        return RolloutBatch(
            request_id=request_id, version=self.version, prompts=request.prompts, groups=groups
        )


def test_dynamic_sampling_drops_uniform_groups_and_refills(tmp_path):
    cfg = rl_config(
        tmp_path, None, [("1+2=", "3")], steps=2, prompts_per_step=3, group_size=4, max_staleness=0
    )
    result = train_rlvr(cfg, Recorder(), never, worker_factory=UniformWorker)
    assert [(s.groups_uniform, s.groups_kept, s.rounds) for s in result.stats] == [(3, 3, 2), (3, 3, 2)]


def all_wrong_one_long(group_size: int) -> list[Completion]:
    """Every answer wrong; the last one 6 tokens long, inside the overlong buffer (reward -1/3)."""
    return [completion("x\n") for _ in range(group_size - 1)] + [completion("xxxxx\n")]


class AllWrongWorker(FakeWorker):
    """Fresh rollouts; every group all wrong, one answer in each slightly long."""

    def collect(self, request_id):
        request = self.pending.pop(request_id)
        groups = [all_wrong_one_long(request.group_size) for _ in request.prompts]
        return RolloutBatch(
            request_id=request_id, version=self.version, prompts=request.prompts, groups=groups
        )


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")  # no group kept: no optimizer step
def test_dynamic_sampling_judges_correctness_not_the_shaped_reward(tmp_path):
    # Rewards [0 x 7, -1/3] differ, so a filter on the shaped reward kept these groups, and their
    # normalised advantages are those of a group with one right answer: the length penalty alone
    # would be taught as hard as correctness. DAPO keeps a group only if its accuracy varies.
    shaped = torch.tensor([[0.0] * 7 + [-1 / 3]])
    one_right = torch.tensor([[0.0] * 7 + [1.0]])
    assert torch.allclose(group_advantages(shaped), -group_advantages(one_right))
    emit = Recorder()
    cfg = rl_config(
        tmp_path,
        None,
        [("1+2=", "3")],
        steps=1,
        prompts_per_step=2,
        group_size=8,
        max_staleness=0,
        max_sampling_rounds=2,
    )
    result = train_rlvr(cfg, emit, never, worker_factory=AllWrongWorker)
    assert [(s.groups_uniform, s.groups_kept, s.rounds) for s in result.stats] == [(4, 0, 2)]
    assert result.stats[0].accuracy == 0.0 and result.stats[0].reward == pytest.approx(-1 / 24)
    assert any("nothing to learn" in e.message for e in emit.of(LogLine))
