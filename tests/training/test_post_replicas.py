"""SFT, DPO and RLVR as torchft replica groups (a run on several nodes: each node one group): two groups
of one process each, in two threads of this process, meeting at an in-process Lighthouse. Each
trains its half of every global batch; they end with the same weights, and those are one process's
on the whole batch (token means over the global batch: torchft's average of the two halves is the
one-process gradient), within float tolerance."""

import pathlib
import threading

import pytest
import torch

pytest.importorskip("torchft", reason="torchft is not installed: `pip install torchft==0.2.0`")

from contracts.manifest import RlvrStage
from contracts.models import MODEL_SHAPES
from tests.support import replica_seal
from training.data.corpora import load_text, task_problems
from training.engine.fault_tolerance import ReplicaGroup, start_lighthouse, weights_checksum
from training.engine.reporting import Recorder
from training.recipes.generation import Completion
from training.recipes.posttrain import PostConfig, PostResult, train_dpo, train_sft
from training.recipes.pretrain import StageConfig, train_stage
from training.recipes.rlvr import RlvrConfig, RlvrResult, train_rlvr
from training.recipes.rollout import RolloutBatch
from training.recipes.stage_run import Replicas

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TINY = MODEL_SHAPES["tiny"]
SMALL = "generated:small_arithmetic"
STEPS = 6
JOIN_S = 120  # two groups' first quorum and six steps on a busy 2-core host; ~10 s idle


def never() -> bool:
    return False


def config(stage: str, root: pathlib.Path, tag: str, init_from: str) -> PostConfig:
    return PostConfig(
        stage=stage,
        shape=TINY,
        rope_base=None,
        problems=task_problems(load_text(SMALL)),
        steps=STEPS,
        batch_size=8,
        learning_rate=1e-3,
        seed=0,
        checkpoint_dir=str(root / tag / stage),
        checkpoint_interval=1000,
        init_from=init_from,
    )


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("pre")
    cfg = StageConfig(
        stage="pretrain",
        shape=TINY,
        train_sources=[SMALL],
        seq_len=32,
        batch_size=8,
        learning_rate=3e-3,
        steps=4,
        checkpoint_dir=str(root / "pretrain"),
        checkpoint_interval=1000,
        eval_max_batches=1,
    )
    train_stage(cfg, Recorder(), never)
    return str(root / "pretrain")


@pytest.mark.parametrize(("stage", "train"), [("sft", train_sft), ("dpo", train_dpo)])
def test_two_replica_groups_train_their_halves_to_one_process_weights(tmp_path, pretrained, stage, train):
    alone = train(config(stage, tmp_path, "alone", pretrained), Recorder(), never)
    lighthouse = start_lighthouse()
    results: dict[int, PostResult] = {}
    errors: list[BaseException] = []
    steps: dict[int, list[int]] = {0: [], 1: []}

    def group(replica_id: int) -> None:
        def join(model, optimizer, scheduler) -> ReplicaGroup:
            return ReplicaGroup(
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                replica_id=replica_id,
                lighthouse=lighthouse.address(),
                seal=replica_seal(replica_id),
                expected_groups=2,
                progress=lambda event, /, **f: (
                    steps[replica_id].append(int(f["participants"])) if event == "step" else None
                ),
            )

        try:
            cfg = config(stage, tmp_path, f"node-{replica_id}", pretrained)
            replicas = Replicas(replica_id=replica_id, groups=2, join=join)
            results[replica_id] = train(cfg, Recorder(), never, replicas)
        except BaseException as e:  # raised in the test thread below
            errors.append(e)

    threads = [threading.Thread(target=group, args=(i,), daemon=True) for i in (0, 1)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(JOIN_S)
    finally:
        lighthouse.shutdown()
    assert not errors, errors
    assert sorted(results) == [0, 1] and all(not t.is_alive() for t in threads)
    assert [r.final_step for r in results.values()] == [STEPS, STEPS]
    assert all(n == 2 for n in steps[0] + steps[1]), steps  # every step had both groups in its quorum
    a, b = (results[i].model for i in (0, 1))
    assert a is not None and b is not None and alone.model is not None
    assert weights_checksum(a) == weights_checksum(b)  # the two groups hold the same weights
    start = torch.nn.utils.parameters_to_vector(config_model(pretrained).parameters())
    one = torch.nn.utils.parameters_to_vector(alone.model.parameters())
    two = torch.nn.utils.parameters_to_vector(a.parameters())
    moved = (one - start).norm()
    assert moved > 0
    assert (two - one).norm() < 1e-3 * moved, ((two - one).norm(), moved)  # one process's update


def config_model(pretrained: str) -> torch.nn.Module:
    """The incoming weights, as the stages load them."""
    from training.engine.checkpoint_load import load_weights
    from training.model import Transformer

    model = Transformer(TINY)
    assert load_weights(pretrained, model) is not None
    return model


class ScriptedWorker:
    """A rollout worker that answers every prompt with fixed completions: alternately right and
    wrong (`mixed`: every group kept), or all right (uniform: none kept)."""

    def __init__(self, mixed: bool, started: list[bool]):
        self.mixed, self.pending = mixed, {}
        started.append(mixed)

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
        groups = [
            [completion("3\n" if i % 2 or not self.mixed else "x\n") for i in range(request.group_size)]
            for _ in request.prompts
        ]
        return RolloutBatch(
            request_id=request_id, version=self.version, prompts=request.prompts, groups=groups
        )


def completion(text: str) -> Completion:
    tokens = list(text.encode())
    return Completion(tokens=tokens, logprobs=[-1.0] * len(tokens), finished=True)


def rl_config(root: pathlib.Path, tag: str, init_from: str, prompts: int) -> RlvrConfig:
    rlvr = RlvrStage(
        prompts_per_step=prompts,
        group_size=4,
        max_response_tokens=4,
        overlong_buffer_tokens=2,
        max_staleness=0,
    )
    return RlvrConfig(
        stage="rlvr",
        shape=TINY,
        rope_base=None,
        problems=[("1+2=", "3")],
        steps=3,
        batch_size=prompts * 4,
        learning_rate=3e-4,
        seed=0,
        checkpoint_dir=str(root / tag / "rlvr"),
        checkpoint_interval=1000,
        init_from=init_from,
        rlvr=rlvr,
    )


@pytest.mark.parametrize("mixed", [(True, True), (True, False)])
def test_two_replica_groups_run_rlvr_each_with_its_own_rollout_worker(tmp_path, pretrained, mixed):
    """RLVR as two replica groups: rank 0 of each runs one rollout worker and samples the group's
    share of the step's prompts (here one each, of one task, so the two shares are what one process
    samples for two). Both groups keep theirs: the token mean is over both groups' kept tokens, and
    the weights are one process's on both shares. Group 1 keeps none: it trains a weightless row (so
    both still step together), and the weights are one process's on group 0's share alone."""
    started: list[bool] = []
    alone = train_rlvr(
        rl_config(tmp_path, "alone", pretrained, sum(mixed)),
        Recorder(),
        never,
        worker_factory=lambda *a, **k: ScriptedWorker(True, started),
    )
    lighthouse = start_lighthouse()
    results: dict[int, RlvrResult] = {}
    errors: list[BaseException] = []

    def group(replica_id: int) -> None:
        def join(model, optimizer, scheduler) -> ReplicaGroup:
            return ReplicaGroup(
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                replica_id=replica_id,
                lighthouse=lighthouse.address(),
                seal=replica_seal(replica_id),
                expected_groups=2,
            )

        try:
            results[replica_id] = train_rlvr(
                rl_config(tmp_path, f"node-{replica_id}", pretrained, 2),
                Recorder(),
                never,
                worker_factory=lambda *a, **k: ScriptedWorker(mixed[replica_id], started),
                replicas=Replicas(replica_id=replica_id, groups=2, join=join),
            )
        except BaseException as e:  # raised in the test thread below
            errors.append(e)

    threads = [threading.Thread(target=group, args=(i,), daemon=True) for i in (0, 1)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(JOIN_S)
    finally:
        lighthouse.shutdown()
    assert not errors, errors
    assert sorted(results) == [0, 1] and all(not t.is_alive() for t in threads)
    assert [r.final_step for r in results.values()] == [3, 3]
    assert sorted(started) == sorted([True, *mixed])  # one worker per group (and the lone process's)
    for i in (0, 1):  # each group's share: 1 of the step's 2 prompts
        assert [st.groups_kept for st in results[i].stats] == [int(mixed[i])] * 3
    a, b = (results[i].model for i in (0, 1))
    assert a is not None and b is not None and alone.model is not None
    assert weights_checksum(a) == weights_checksum(b)
    start = torch.nn.utils.parameters_to_vector(config_model(pretrained).parameters())
    one = torch.nn.utils.parameters_to_vector(alone.model.parameters())
    two = torch.nn.utils.parameters_to_vector(a.parameters())
    moved = (one - start).norm()
    assert moved > 0
    assert (two - one).norm() < 1e-3 * moved, ((two - one).norm(), moved)
