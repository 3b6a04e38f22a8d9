"""What many tests share that is not a fixture: `eventually`, the one bounded wait.

A test that waits for another process (a run's state, a consumer catching up) polls a probe until
it returns something truthy, and fails with the last value it saw when the bound passes, so that a
hang is a failure with a reason, never a stuck suite.
"""

import asyncio
import contextlib
import json
import os
import pathlib
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

from runtime.configuration.settings import usable_cpus

T = TypeVar("T")

THREADS = max(1, usable_cpus() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1))
"""Torch threads for training in a test process: its worker's share of the cores. Two workers on
two cores with two threads each oversubscribe the cores, and OpenMP's waiting threads spin: the
in-process trainer tests took a quarter longer (tests/conftest.py sets it for every process)."""


def eventually(probe: Callable[[], T], *, timeout: float, interval: float = 0.3, what: str = "") -> T:
    """`probe()` until it is truthy; returns that value. AssertionError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout:g}s: {what or repr(probe)}; last: {value!r}")
        time.sleep(interval)


async def eventually_async(
    probe: Callable[[], Awaitable[T]], *, timeout: float, interval: float = 0.1, what: str = ""
) -> T:
    """The coroutine form of `eventually`, for tests that run on the event loop."""
    deadline = time.monotonic() + timeout
    while True:
        value = await probe()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout:g}s: {what or repr(probe)}; last: {value!r}")
        await asyncio.sleep(interval)


def run_state(stack, env: dict, run_id: str, states, timeout: float = 180) -> dict:
    """A run's status once its state is one of `states` (through `ecc ito status`, as a user sees it)."""
    return run_status(stack, env, run_id, lambda v: v["state"] in states, timeout=timeout)


def run_status(stack, env: dict, run_id: str, predicate, timeout: float = 120) -> dict:
    """A run's status (`ecc ito status`) once `predicate(status)` holds."""
    last: dict = {}

    def probe():
        rc, out = stack.ecc("status", run_id, env=env)
        assert rc == 0, out
        last.update(out["data"])
        return out["data"] if predicate(out["data"]) else None

    return eventually(probe, timeout=timeout, what=f"run {run_id} status")


def confirm_and_train(
    stack, env: dict, booking: str, manifest: str, key: str, max_cost: float | None = None
) -> dict:
    """`ecc ito confirm --action train` (with `--max-cost` when given: the confirmation must carry
    it) then `ecc ito train` with its ref, as a user does; the train answer, which must be ok."""
    bound = [] if max_cost is None else ["--max-cost", str(max_cost)]
    confirm = ["confirm", "--action", "train", "--booking", booking, "--manifest", manifest, *bound]
    _, conf = stack.ecc(*confirm, env=env)
    assert max_cost is None or abs(conf["data"]["max_cost_usd"] - max_cost) < 1e-9, conf
    ref = conf["data"]["confirmation_ref"]
    rc, train = stack.ecc(
        "train",
        "--booking",
        booking,
        "--manifest",
        manifest,
        "--confirmation-ref",
        ref,
        "--idempotency-key",
        key,
        env=env,
    )
    assert rc == 0 and train["ok"], train
    return train


def approve_restart(stack, env: dict, run_id: str, key: str) -> dict:
    """`ecc ito confirm --action restart_from_checkpoint` then `ecc ito approve` with its ref, as a
    user approves a paused run's proposal; the answer, which must requeue the run."""
    _, conf = stack.ecc("confirm", "--action", "restart_from_checkpoint", "--run", run_id, env=env)
    ref = conf["data"]["confirmation_ref"]
    rc, out = stack.ecc("approve", run_id, "--confirmation-ref", ref, "--idempotency-key", key, env=env)
    assert rc == 0 and out["data"]["state"] == "queued", out
    return out


# The environment every multi-node e2e test runs under: the scheduler may plan the tiny model on
# several nodes, and each process (rank) takes one CPU thread.
MULTI_NODE_ENV = {"ITO_PLAN_SMALL_MODEL_GANGS": "1", "OMP_NUM_THREADS": "1"}


@contextlib.contextmanager
def multi_agent_stack(directory: pathlib.Path, env: dict[str, str] | None = None) -> Iterator[Any]:
    """All services (`up`, whose trainer agent is node 0's or any node's) plus one more trainer
    agent; `stack.start_agent()` starts another (a replacement), `stack.agents` lists them. At the
    end every agent gets SIGTERM (killed past 30 s), then the stack goes down."""
    from tests.conftest import BIN, start_stack  # conftest is pytest's; imported when used

    s = start_stack(directory, env={**MULTI_NODE_ENV, **(env or {})})
    log = open(s.data_dir / "more-trainers.log", "ab")
    s.agents = []

    def start_agent() -> subprocess.Popen:
        agent = subprocess.Popen(
            [str(BIN / "ito-training"), "serve", "trainer"], env=s.env, stdout=log, stderr=log
        )
        s.agents.append(agent)
        return agent

    s.start_agent = start_agent
    start_agent()
    try:
        yield s
    finally:
        for agent in s.agents:
            agent.send_signal(signal.SIGTERM)
        for agent in s.agents:
            try:
                agent.wait(timeout=30)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
        log.close()
        s.run("ito-training", "down", timeout=60)


REPO = pathlib.Path(__file__).resolve().parents[1]
FULL_RECIPE_STEPS = {"pretrain": 12, "sft": 6, "rlvr": 3}  # what `full_recipe` plans


def full_recipe(
    manifest: Callable[..., pathlib.Path], directory: pathlib.Path, resources: dict
) -> pathlib.Path:
    """A manifest (through the `manifest` fixture) of every stage on the tiny model, a few steps
    each: data_prep -> ladder deciding on custom data (a `file:` ref under `directory`: the
    account's file root on the stack, `Stack.file_root`) -> pretrain (12
    steps) -> sft (6) -> rlvr (3), on `resources`. No DPO: its gate asks held-out preference accuracy
    above chance and a positive margin, which a 12-step model does not reach in a few steps (at
    chance, 0.48-0.50, from 4 to 48 steps and lr 1e-4 to 3e-3); DPO through gangs is covered by the
    fine-tune e2e (a 2-rank FSDP2 gang) and tests/distributed/test_posttrain_gang.py."""
    custom = directory / "custom.txt"
    custom.write_text(
        "\n\n".join(
            f"Paragraph {i}: the river runs under the old stone bridge near the mill." for i in range(300)
        )
    )
    custom.chmod(0o644)
    data = json.loads((REPO / "examples" / "manifests" / "tiny.json").read_text())["data"]
    data.append(
        {
            "name": "custom",
            "source": f"file:{custom}",
            "role": "train",
            "decontamination": {"method": "13-gram", "against": [], "provenance": "test"},
        }
    )
    tasks = ["arithmetic"]
    return manifest(
        resources=resources,
        data=data,
        target={"tokens": 12 * 8 * 32, "seq_len": 32, "batch_size": 8, "learning_rate": 0.003},
        checkpoint={"interval_steps": 4, "keep_last": 2, "storage": "local"},
        stages={
            "data_prep": {},
            "ladder": {"proxy_steps": 4, "max_budget_fraction": 0.5},
            "pretrain": {"data": ["python-docs", "arithmetic", "custom"]},
        },
        post_training={
            "recipe": ["sft", "rlvr"],
            "sft": {"steps": 6, "batch_size": 8, "learning_rate": 0.001, "data": tasks},
            "rlvr": {
                "steps": 3,
                "prompts_per_step": 2,
                "group_size": 4,
                "max_response_tokens": 4,
                "overlong_buffer_tokens": 2,
                "data": tasks,
            },
        },
    )


def replica_seal(replica_id: int, run_id: str = "run_replicas_test", epoch: int = 0):
    """A replica group's seal for tests: the heal key of one fixed test secret and `run_id` (every
    group of a test's run gets the same key, as the nodes of a real run derive the same one)."""
    from training.engine.heal_transport import Seal, heal_key

    return Seal(
        key=heal_key("test-rendezvous-secret", run_id), run_id=run_id, replica_id=replica_id, epoch=epoch
    )


@contextlib.contextmanager
def moto_s3() -> Iterator[str]:
    """An S3-compatible server in this process (moto), on a port of its own: its URL. Skips the
    test where moto is not installed."""
    import pytest

    from devstack.infra import free_port

    server_mod = pytest.importorskip("moto.server")
    port = free_port()
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
