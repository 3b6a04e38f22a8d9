"""`ito-training up --cluster` on this machine: a 3-node NATS cluster (streams R3), a Redis
Cluster and two instances of every service. Both instances of each service answer; a run trains
through `ecc`; the NATS node the training agent is connected to is killed mid-run: requests
answer again within seconds, the run still reaches `succeeded`, and `down` stops everything."""

import asyncio
import json
import os
import pathlib
import signal
import time

import pytest

from contracts.subjects import HEALTH, SERVICES, STREAM_AUDIT, STREAM_BOOKINGS, STREAM_RUNS, STREAM_WORK
from devstack import nats_cluster
from runtime.messaging.bus import INSTANCE_HEADER
from tests.conftest import BIN, Stack, new_namespace
from tests.support import confirm_and_train, eventually, run_state, run_status

pytestmark = pytest.mark.e2e

STEPS = 400  # long enough on this machine to kill a node mid-run (~30 steps/s warm), short enough for CI


def start_cluster(data_dir: pathlib.Path) -> tuple[Stack, dict]:
    env = {
        **os.environ,
        "ITO_NAMESPACE": new_namespace(),
        "ITO_DATA_DIR": str(data_dir),
        "ITO_SECRETS_DIR": str(data_dir / "secrets"),
        "ITO_TRAINER_THREADS": "1",
        "ECC_CONNECTION_FILE": str(data_dir / "connection.json"),  # `up` writes it: never into $HOME
        "PATH": f"{BIN}:{os.environ['PATH']}",
    }
    for name in ("ITO_NATS_URL", "ITO_REDIS_URL"):  # `up` starts its own; never the machine's
        env.pop(name, None)
    s = Stack(env, data_dir)
    up = s.run("ito-training", "up", "--cluster", "--detach", "--json", timeout=240)
    assert up.returncode == 0, up.stderr[-3000:]
    started = json.loads(up.stdout.strip().splitlines()[-1])
    s.env["ITO_NATS_URL"], s.env["ITO_REDIS_URL"] = started["nats_url"], started["redis_url"]
    return s, started


def state_of(s: Stack) -> dict:
    return json.loads((s.data_dir / "up.json").read_text())


def alive(pid: int) -> bool:
    """Running, not a zombie (the node restarted here is this process's child until reaped)."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def connected_ports(pid: int) -> set[int]:
    """The remote loopback ports of `pid`'s TCP connections (from /proc: no tool needed)."""
    inodes = set()
    for fd in pathlib.Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for line in pathlib.Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[9] in inodes and fields[3] == "01":  # ESTABLISHED
            ports.add(int(fields[2].split(":")[1], 16))
    return ports


def cpu_ticks(pid: int) -> int:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


async def instances_answering(s: Stack, nodes: list[nats_cluster.Node]) -> dict[str, set[str]]:
    """Per service, the instances that answered its health check, asked through every node."""
    seen: dict[str, set[str]] = {name: set() for name in SERVICES}
    for node in nodes:
        nc = await s.nats(url=node.url, allow_reconnect=False)
        try:
            for name in SERVICES:
                for _ in range(6):
                    reply = await nc.request(s.settings.subject(f"{HEALTH}.{name}"), b"{}", timeout=2)
                    seen[name].add(reply.headers[INSTANCE_HEADER])
        finally:
            await nc.close()
    return seen


async def replicas(s: Stack) -> dict[str, int]:
    nc = await s.nats()
    try:
        js = nc.jetstream(timeout=5)
        names = (STREAM_BOOKINGS, STREAM_WORK, STREAM_RUNS, STREAM_AUDIT)
        infos = [await js.stream_info(s.settings.stream(n)) for n in names]
        return {i.config.name: i.config.num_replicas for i in infos}
    finally:
        await nc.close()


@pytest.mark.chaos  # long: `make chaos` runs it (its short version stays in the suite)
def test_cluster_trains_through_the_loss_of_a_nats_node(tmp_path_factory, manifest):
    began = time.monotonic()
    s, started = start_cluster(tmp_path_factory.mktemp("cluster"))
    try:
        st = state_of(s)
        nodes = nats_cluster.nodes_from_state(st["nats_nodes"])
        assert sorted(st["services"]) == sorted(f"{n}-{i}" for n in SERVICES for i in (1, 2))
        assert started["cluster"] and len(s.settings.nats_servers) == 3
        assert st["redis_cluster"] and sorted(n for n in st["infra"] if n.startswith("redis")) == [
            f"redis-{i}" for i in range(1, 7)
        ]  # 3 primaries and their replicas

        # the route secret: in 0600 files only, in no server's arguments and no log line
        secret = (s.settings.secrets_dir / nats_cluster.ROUTE_SECRET).read_text().strip()
        for node in nodes:
            assert os.stat(s.settings.secrets_dir / f"{node.name}.conf").st_mode & 0o777 == 0o600
            cmdline = pathlib.Path(f"/proc/{st['infra'][node.name]}/cmdline").read_bytes()
            assert secret.encode() not in cmdline
        logs = pathlib.Path(st["logs"])
        assert not any(secret in p.read_text(errors="replace") for p in logs.glob("*.log"))

        # both instances of every service answer (their queue group shares the requests)
        seen = asyncio.run(instances_answering(s, nodes))
        assert seen == {n: {f"{n}-1", f"{n}-2"} for n in SERVICES}, seen
        assert set(asyncio.run(replicas(s)).values()) == {3}

        account, _, env = s.account()
        booking = s.booking(account)
        m = str(
            manifest(
                target={"tokens": STEPS * 8 * 32, "seq_len": 32, "batch_size": 8, "learning_rate": 0.003},
                checkpoint={"interval_steps": 40, "keep_last": 2, "storage": "local"},
            )
        )
        run_id = confirm_and_train(s, env, booking, m, "cluster-1")["data"]["run_id"]
        run_status(s, env, run_id, lambda v: v["state"] == "running" and v["step"] >= 5, timeout=90)

        # the node the training agent talks through (the agent busy right now is the one training)
        trainers = [st["services"][f"trainer-{i}"] for i in (1, 2)]
        before = {pid: cpu_ticks(pid) for pid in trainers}
        time.sleep(1.0)
        busy = max(trainers, key=lambda pid: cpu_ticks(pid) - before[pid])
        victim = next(n for n in nodes if n.client_port in connected_ports(busy))
        rc, before_kill = s.ecc("status", run_id, env=env)
        assert rc == 0 and before_kill["data"]["state"] == "running", before_kill  # mid-run, not after
        killed_at = time.monotonic()
        os.kill(st["infra"][victim.name], signal.SIGKILL)

        def answers() -> bool:
            rc, out = s.ecc("status", run_id, env=env, timeout=30)
            return rc == 0 and out["ok"]

        eventually(answers, timeout=30, interval=0.1, what="a request answered after the node kill")
        recovered_s = time.monotonic() - killed_at
        assert all(answers() for _ in range(5))  # and keep answering, whichever node ecc picks
        final = run_state(s, env, run_id, {"succeeded", "failed"}, timeout=150)
        assert final["state"] == "succeeded", final

        # the killed node starts again on its ports, rejoins, and requests through it are answered
        s.restart_infra(victim.name)
        assert asyncio.run(instances_answering(s, [victim]))["scheduler"]
        # so does a Redis node (a replica as formed: no failover to wait for)
        os.kill(st["infra"]["redis-6"], signal.SIGKILL)
        s.restart_infra("redis-6")
        st = state_of(s)
        assert (
            alive(st["infra"]["redis-6"]) and st["redis_nodes"]["nodes"][5]["pid"] == st["infra"]["redis-6"]
        )
        print(
            f"cluster ready in {st['ready_s']} s; requests answered {recovered_s:.2f} s after "
            f"killing {victim.name} at step {before_kill['data']['step']}/{STEPS}"
        )
    finally:
        down = s.run("ito-training", "down", "--json", timeout=90)
    assert down.returncode == 0, down.stderr[-2000:]
    assert set(json.loads(down.stdout.strip().splitlines()[-1])["stopped"]) == set(st["services"]) | set(
        st["infra"]
    )
    assert not any(alive(pid) for pid in [*st["services"].values(), *st["infra"].values()])
    print(f"cluster e2e: {time.monotonic() - began:.1f} s")
