"""`make chaos`: fault scenarios on stacks of our own, measured and printed as a table.

Scenarios: a trainer killed with SIGKILL mid-stage; a rank of a 2-rank gang killed with SIGKILL
mid-stage (restarted by the elastic launcher, and with no restarts left, interrupted and requeued);
node 1's agent of a run on two agents (two nodes, torchft replica groups) SIGKILLed mid-stage and
replaced, node 0 training on;
the scheduler killed between the ledger's reservation and the hand-off; NATS killed and restarted, then Redis, during a stream of train
requests. For each: detection time, resume time, runs lost, duplicate runs, steps lost (work redone
since the last checkpoint). The cluster section (chaos/cluster.py, `--only cluster`):
exactly-once bursts on `up --cluster` through a NATS node, a Redis primary and a scheduler instance
killed.

Authentication is on throughout: each scenario's stack is `ito-training up` with its own
nats-server (nkeys, allow-lists) and redis-server (ACL users) on loopback, stopped by `down`; the
machine's unauthenticated servers are never used. The load client is a tenant, as `ecc` is (its
NKey, its own inbox, requests on the account's own subjects, no credential in a body); a killed
NATS or Redis comes back through `restart_infra`, from the stack's own config and secrets.
"""

import argparse
import asyncio
import hashlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from chaos.stack import (
    BIN,
    BURST_REQUEST_TIMEOUT_S,
    CONTROL_PLANE,
    REPO,
    Stack,
    fmt,
    tenant_connection,
    wait,
)
from devstack.infra import alive, holder_of
from runtime.configuration import faults
from runtime.configuration.settings import ENV_GANG_MAX_RESTARTS, ENV_PLAN_SMALL_MODEL_GANGS


def trainer_killed(root) -> dict:
    stack = Stack(root)
    try:
        run_id = stack.train(stack.booking(), stack.manifest(800), "kill-1")["data"]["run_id"]
        wait(lambda: (stack.status(run_id).get("last_checkpoint_step") or 0) >= 100, 120)
        killed_step = stack.status(run_id)["step"]
        os.kill(stack.pids()["trainer"], signal.SIGKILL)
        t0 = time.monotonic()
        wait(lambda: stack.status(run_id)["state"] == "interrupted", 60, 0.05)
        detected = time.monotonic() - t0
        replacement = subprocess.Popen(
            [str(BIN / "ito-training"), "serve", "trainer"],
            env=stack.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait(
                lambda: stack.status(run_id)["state"] == "running" and stack.status(run_id)["step"] > 0,
                90,
                0.05,
            )
            resumed = time.monotonic() - t0
            final = wait(
                lambda: (v := stack.status(run_id))["state"] in ("succeeded", "failed") and v, 300, 0.5
            )
            points = stack.ecc("metrics", run_id)["data"]["points"]
            steps = [p["step"] for p in points]
            restart = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
            # steps trained twice: from the resumed checkpoint to the last step reported before the
            # kill (the status at the kill lags the trainer, so it cannot bound this)
            lost = max(killed_step, steps[restart - 1]) - (steps[restart] - 1)
        finally:
            replacement.terminate()
        return {
            "scenario": "trainer SIGKILL mid-stage",
            "detection_s": detected,
            "resume_s": resumed,
            "runs_lost": int(final["state"] != "succeeded"),
            "duplicate_runs": 0,
            "steps_lost": lost,
        }
    finally:
        stack.down()


def gang_ranks(job: pathlib.Path) -> list[int]:
    """The pids of the ranks running a gang's `job` (launch.rank processes, not their launcher)."""
    pids = []
    for proc in pathlib.Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0") if proc.name.isdigit() else []
        except OSError:
            continue
        if (
            str(job).encode() in argv
            and b"training.launch.rank" in argv
            and b"torch.distributed.run" not in argv
        ):
            pids.append(int(proc.name))
    return pids


def restart_in(points: list[dict]) -> int | None:
    """The first step trained again after a restart (a step not above the one before), or None."""
    steps = [p["step"] for p in points]
    return next((steps[i] for i in range(1, len(steps)) if steps[i] <= steps[i - 1]), None)


def gang_rank_killed(root, max_restarts: int) -> dict:
    """A 2-rank gang (CPU, gloo; the tiny model planned on 2 "GPUs" of a node) with one rank
    SIGKILLed mid-stage. With restarts left, the elastic launcher restarts the gang: detection is
    the kill until its next attempt starts. With none (max_restarts=0), the agent interrupts the
    run and requeues it: detection is the kill until `interrupted`. Resume: the kill until a step
    past the checkpoint is trained again; steps lost: work redone since that checkpoint."""
    env = {ENV_PLAN_SMALL_MODEL_GANGS: "1", ENV_GANG_MAX_RESTARTS: str(max_restarts)}
    stack = Stack(root, env=env)
    try:
        manifest = stack.manifest(120, gpus=2, interval=10)
        run_id = stack.train(stack.booking(), manifest, "gang-kill")["data"]["run_id"]
        view = wait(
            lambda: ((v := stack.status(run_id)).get("last_checkpoint_step") or 0) >= 20 and v, 300, 0.5
        )
        job = pathlib.Path(view["checkpoint_dir"]) / "gang" / "pretrain" / "job.json"
        ranks = wait(lambda: len(p := gang_ranks(job)) == 2 and p, 30)
        killed_step = stack.status(run_id)["step"]
        os.kill(ranks[-1], signal.SIGKILL)
        t0 = time.monotonic()
        if max_restarts:
            attempt = job.parent / "logs"
            wait(lambda: any(attempt.glob("*/attempt_1")), 120, 0.05)
        else:
            wait(lambda: stack.status(run_id)["state"] == "interrupted", 120, 0.05)
        detected = time.monotonic() - t0
        restarted = wait(lambda: restart_in(stack.ecc("metrics", run_id)["data"]["points"]), 300, 0.2)
        resumed = time.monotonic() - t0
        final = wait(lambda: (v := stack.status(run_id))["state"] in ("succeeded", "failed") and v, 300, 0.5)
        how = (
            f"restarted by torchrun, max_restarts={max_restarts}"
            if max_restarts
            else "interrupted and requeued"
        )
        return {
            "scenario": f"2-rank gang, rank SIGKILL ({'launcher restart' if max_restarts else 'requeue'})",
            "detection_s": detected,
            "resume_s": resumed,
            "runs_lost": int(final["state"] != "succeeded"),
            "duplicate_runs": 0,
            "steps_lost": killed_step - (restarted - 1),
            "note": f"{how}; killed at step {killed_step}, resumed at {restarted}",
        }
    finally:
        stack.down()


def node_events(path: pathlib.Path) -> list[dict]:
    """A node's log (node n > 0 of a multi-node run), whole lines only."""
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def agent_killed(root) -> dict:
    """A run on two agents (two nodes, one torchft replica group each) with node 1's agent
    SIGKILLed mid-stage and a replacement agent started at once; node 0 trains on. Detection: the
    kill until the replacement leases node 1's redelivered item (a new epoch in node 1's log);
    resume: the kill until node 1 trains a step again (after resuming its checkpoint and healing
    from node 0); steps redone: node 1's steps trained again (none once it heals to node 0's step)."""
    stack = Stack(root, env={ENV_PLAN_SMALL_MODEL_GANGS: "1", "OMP_NUM_THREADS": "1"})
    agents = [
        subprocess.Popen(
            [str(BIN / "ito-training"), "serve", "trainer"],
            env=stack.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    try:
        manifest = stack.manifest(500, interval=20, nodes=2)
        run_id = stack.train(stack.booking(nodes=2), manifest, "agent-kill")["data"]["run_id"]
        view = wait(lambda: (v := stack.status(run_id)).get("checkpoint_dir") and v, 120, 0.2)
        node1 = pathlib.Path(view["checkpoint_dir"]) / "node-1"
        wait(lambda: any((node1 / "pretrain").glob("step-*/COMMITTED")), 300, 0.1)
        pid = wait(lambda: holder_of(node1 / "node.jsonl", [stack.pids()["trainer"], agents[0].pid]), 30)
        node0 = next(p for p in (stack.pids()["trainer"], agents[0].pid) if p != pid)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        before = node_events(node1 / "node.jsonl")
        killed_step = max(e["step"] for e in before if e.get("kind") == "metrics")
        epoch = max(e["epoch"] for e in before)
        agents.append(
            subprocess.Popen(
                [str(BIN / "ito-training"), "serve", "trainer"],
                env=stack.env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )

        def later() -> list[dict]:  # node 1's events under the replacement's (higher) epoch
            return [e for e in node_events(node1 / "node.jsonl") if e["epoch"] > epoch]

        wait(later, 120, 0.05)
        detected = time.monotonic() - t0
        wait(lambda: any(e.get("kind") == "metrics" for e in later()), 120, 0.05)
        resumed = time.monotonic() - t0
        final = wait(
            lambda: (v := stack.status(run_id))["state"] in ("succeeded", "failed", "gate_failed") and v,
            300,
            0.5,
        )
        events = later()
        messages = [e.get("message", "") for e in events]
        trained = [e["step"] for e in events if e.get("kind") == "metrics"]
        checkpoint = next((m.rsplit(" ", 1)[1] for m in messages if "resumed at step" in m), "none")
        healed = next((m.rsplit(" ", 1)[1] for m in messages if "healed at step" in m), "never")
        return {
            "scenario": "2-agent run, node 1's agent SIGKILL",
            "detection_s": detected,
            "resume_s": resumed,
            "runs_lost": int(final["state"] != "succeeded"),
            "duplicate_runs": 0,
            "steps_lost": max(0, killed_step - (min(trained) - 1)),
            "note": (
                f"node 1 killed at step {killed_step}, resumed its checkpoint at {checkpoint}, healed "
                f"from node 0 at {healed}; node 0's agent {'never stopped' if alive(node0) else 'gone'}, "
                f"run {final['state']}"
            ),
        }
    finally:
        for agent in agents:
            agent.terminate()
        for agent in agents:
            try:
                agent.wait(timeout=30)
            except subprocess.TimeoutExpired:
                agent.kill()
        stack.down()


def scheduler_killed(root) -> dict:
    stack = Stack(root, CONTROL_PLANE)
    try:
        pid = stack.pids()["scheduler"]
        os.kill(pid, signal.SIGTERM)
        time.sleep(1)
        crashing = subprocess.Popen(
            [str(BIN / "ito-training"), "serve", "scheduler"],
            env={**stack.env, faults.ENV_FAULT_POINT: faults.SCHEDULER_AFTER_ACCEPT},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait(lambda: stack.ecc("auth").get("ok"), 30)
        booking, manifest = stack.booking(), stack.manifest(10)
        answer = stack.train(booking, manifest, "crash-1")
        crashing.wait(timeout=10)
        t0 = time.monotonic()
        healthy = subprocess.Popen(
            [str(BIN / "ito-training"), "serve", "scheduler"],
            env=stack.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            view = wait(
                lambda: (
                    (o := stack.ecc("status", "--idempotency-key", "crash-1")).get("ok")
                    and o["data"]["state"] == "queued"
                    and o["data"]
                ),
                60,
                0.1,
            )
            resumed = time.monotonic() - t0
            queued = stack.queued()
        finally:
            healthy.terminate()
        return {
            "scenario": "scheduler SIGKILL after reservation",
            "detection_s": None,
            "resume_s": resumed,
            "runs_lost": int(not view),
            "duplicate_runs": max(0, queued - 1),
            "steps_lost": 0,
            "note": f"the CLI answered {answer.get('error', {}).get('code', 'ok')}",
        }
    finally:
        stack.down()


def restarted_during_burst(root, name: str) -> dict:
    """The stack's own `name` server ("nats" or "redis") SIGKILLed and restarted while a tenant
    sends a stream of confirm + train requests."""
    stack = Stack(root, CONTROL_PLANE)
    try:
        booking, manifest = stack.booking(), stack.manifest(10)
        text = manifest.read_text()
        digest = hashlib.sha256(manifest.read_bytes()).hexdigest()
        results, t_restart = asyncio.run(_burst_with_restart(stack, booking, text, digest, name))
        accepted = {k: out["data"]["run_id"] for k, out in results if out.get("ok")}
        found = {}
        for k, _ in results:
            out = stack.ecc("status", "--idempotency-key", k)
            if out.get("ok"):
                found[k] = out["data"]["run_id"]
        lost = sum(1 for k in accepted if found.get(k) != accepted[k])
        queued = wait(lambda: (q := stack.queued()) >= len(found) and q, 30, 0.5)
        return {
            "scenario": f"{name} restart during a burst",
            "detection_s": None,
            "resume_s": t_restart,
            "runs_lost": lost,
            "duplicate_runs": queued - len(set(found.values())),
            "steps_lost": 0,
            "note": f"{len(accepted)}/{len(results)} answered ok, {len(found)} runs",
        }
    finally:
        stack.down()  # `down` stops the restarted server too: restart_infra recorded its pid


async def _burst_with_restart(stack, booking, text, digest, name):
    """([(idempotency key, answer)], seconds from the kill until the server was back): a burst
    of confirm + train requests while `name` is SIGKILLed and restarted."""
    nc = await tenant_connection(stack)
    restarter = asyncio.create_task(_kill_and_restart(stack, name))
    try:
        results = await _burst(nc, stack, booking, text, digest)
        t = await restarter
    finally:
        await nc.close()
    return results, t


async def _kill_and_restart(stack, name) -> float:
    """SIGKILL the server a second into the burst; the seconds until it answers again."""
    from devstack.stack import restart_infra

    await asyncio.sleep(1.0)
    os.kill(stack.infra_pid(name), signal.SIGKILL)
    t0 = time.monotonic()
    await asyncio.sleep(1.0)
    # Same port, config and secrets; in a thread: it blocks until the server answers.
    await asyncio.to_thread(restart_infra, stack.settings(), name)
    return time.monotonic() - t0


async def _burst(nc, stack, booking, text, digest):
    """60 confirm + train pairs, each train under its own idempotency key."""

    async def call(suffix, **body):
        # On the account's own subject, with no credential in the body: the server authenticated us.
        try:
            reply = await nc.request(
                f"{stack.ns}.{suffix}.{stack.account}",
                json.dumps(body).encode(),
                timeout=BURST_REQUEST_TIMEOUT_S,
            )
            return json.loads(reply.data)
        except Exception as exc:  # the answer was lost in the outage
            return {"ok": False, "transport": type(exc).__name__}

    results = []
    for i in range(60):
        conf = await call(
            "v1.api.confirm", action="train", booking_id=booking, manifest_text=text, manifest_digest=digest
        )
        if conf.get("ok"):
            out = await call(
                "v1.api.train",
                booking_id=booking,
                manifest_text=text,
                manifest_digest=digest,
                confirmation_ref=conf["data"]["confirmation_ref"],
                idempotency_key=f"b{i}",
            )
        else:
            out = conf
        results.append((f"b{i}", out))
        await asyncio.sleep(0.05)
    return results


def record(rows: list[dict], whole: bool) -> None:
    """bench/chaos.json: the whole table after a full run; after `--only`, the rows of the
    scenarios that ran replace their earlier rows (so the cluster section can be run by itself)."""
    out = REPO / "bench" / "chaos.json"
    out.parent.mkdir(exist_ok=True)
    if not whole:
        try:
            kept = [
                r for r in json.loads(out.read_text()) if r["scenario"] not in {x["scenario"] for x in rows}
            ]
        except (OSError, ValueError):
            kept = []
        rows = kept + rows
    out.write_text(json.dumps(rows, indent=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m chaos.scenarios", description="Fault scenarios on stacks of our own, as a table."
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="TEXT",
        help="run only the scenarios whose name contains TEXT (repeatable, e.g. `--only cluster`); "
        "their rows replace theirs in bench/chaos.json, the others are kept",
    )
    args = parser.parse_args(argv)
    from chaos import cluster as chaos_cluster

    root = pathlib.Path(tempfile.mkdtemp(prefix="ito-chaos-"))
    rows: list[dict] = []
    scenarios: list[tuple[str, Callable[[], dict | list[dict]]]] = [
        ("trainer SIGKILL mid-stage", lambda: trainer_killed(root)),
        ("2-rank gang, rank SIGKILL (launcher restart)", lambda: gang_rank_killed(root, max_restarts=2)),
        ("2-rank gang, rank SIGKILL (requeue)", lambda: gang_rank_killed(root, max_restarts=0)),
        ("2-agent run, node 1's agent SIGKILL", lambda: agent_killed(root)),
        ("scheduler SIGKILL after reservation", lambda: scheduler_killed(root)),
        ("nats restart during a burst", lambda: restarted_during_burst(root, "nats")),
        ("redis restart during a burst", lambda: restarted_during_burst(root, "redis")),
        *chaos_cluster.scenarios(root),
    ]
    if args.only:
        scenarios = [(n, s) for n, s in scenarios if any(text in n for text in args.only)]
    for name, scenario in scenarios:
        try:
            out = scenario()  # the cluster section: one row per fault, all on one cluster
            new: list[dict] = out if isinstance(out, list) else [out]
        except Exception as exc:  # one failed scenario is reported, the others still run
            new = [{"scenario": name, "error": f"{type(exc).__name__}: {exc}"[:200]}]
        rows.extend(new)
        for row in new:
            print(json.dumps(row), flush=True)
    if any(r.get("error") for r in rows):
        print(f"logs of the stacks: {root}/*/logs", file=sys.stderr)
    else:  # every stack is down; what is left is their data, logs and secrets
        shutil.rmtree(root, ignore_errors=True)
    header = ("scenario", "detection_s", "resume_s", "runs_lost", "duplicate_runs", "steps_lost")
    print("\n" + " | ".join(header))
    for row in rows:
        print(
            " | ".join(fmt(row.get(h)) for h in header)
            + (f"  ({row['note']})" if row.get("note") else "")
            + (f"  ERROR {row['error']}" if row.get("error") else "")
        )
    chaos_cluster.print_table(rows)
    record(rows, whole=not args.only)
    return 1 if any(r.get("error") or r.get("runs_lost") or r.get("duplicate_runs") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
