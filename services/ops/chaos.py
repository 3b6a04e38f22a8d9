"""`make chaos`: fault scenarios on embedded infra, measured and printed as a table.

Scenarios: a trainer killed with SIGKILL mid-stage; the scheduler killed between the ledger's
reservation and the hand-off; NATS killed and restarted, then Redis, during a stream of train
requests. For each: detection time, resume time, runs lost, duplicate runs, steps lost (work redone
since the last checkpoint). Everything runs on servers this script starts on loopback and stops.
"""

import asyncio
import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
import uuid

from services.runtime import faults, infra

BIN = pathlib.Path(sys.executable).parent
REPO = pathlib.Path(__file__).resolve().parents[2]
CONTROL_PLANE = "entitlement,confirmation,ledger,scheduler"


class Stack:
    def __init__(self, root: pathlib.Path, nats_url: str, redis_url: str, services: str | None = None) -> None:
        self.ns = "chaos" + uuid.uuid4().hex[:8]
        self.dir = root / self.ns
        self.env = {**os.environ, "ITO_NATS_URL": nats_url, "ITO_REDIS_URL": redis_url, "ITO_NAMESPACE": self.ns,
                    "ITO_DATA_DIR": str(self.dir), "ECC_CONFIG_DIR": str(self.dir / "ecc"),
                    "ITO_TRAINER_THREADS": "1"}
        args = ["up", "--detach", "--json"] + (["--services", services] if services else [])
        self.cli("ito-training", *args, timeout=180)
        self.account = "chaos"
        key = self.cli("ito-training", "accounts", "create", self.account, "--json")["api_key"]
        self.cli("ecc", "ito", "login", "--account", self.account, "--json", input=key + "\n")
        self.key = key

    def cli(self, exe: str, *args: str, input: str | None = None, timeout: float = 60, check: bool = True):
        proc = subprocess.run([str(BIN / exe), *args], env=self.env, input=input, capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{exe} {' '.join(args[:2])}: {proc.stderr[-500:] or proc.stdout[-500:]}")
        lines = proc.stdout.strip().splitlines()
        return json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}

    def ecc(self, *args: str, timeout: float = 60) -> dict:
        return self.cli("ecc", "ito", *args, "--json", timeout=timeout, check=False)

    def booking(self) -> str:
        booking = "bk-" + uuid.uuid4().hex[:6]
        self.cli("ito-training", "simulate-booking", "--account", self.account, "--booking", booking,
                 "--event", "completed", "--json")
        return booking

    def manifest(self, steps: int) -> pathlib.Path:
        raw = json.loads((REPO / "examples" / "manifests" / "tiny.json").read_text())
        raw["target"] = {"tokens": steps * 8 * 32, "seq_len": 32, "batch_size": 8, "learning_rate": 0.003}
        raw["checkpoint"] = {"interval_steps": 50, "keep_last": 2, "storage": "local"}
        path = self.dir / f"manifest-{steps}.json"
        path.write_text(json.dumps(raw))
        path.chmod(0o644)
        return path

    def train(self, booking: str, manifest: pathlib.Path, key: str) -> dict:
        ref = self.ecc("confirm", "--action", "train", "--booking", booking, "--manifest", str(manifest))
        return self.ecc("train", "--booking", booking, "--manifest", str(manifest), "--confirmation-ref",
                        ref["data"]["confirmation_ref"], "--idempotency-key", key, "--timeout", "5")

    def status(self, run_id: str) -> dict:
        return self.ecc("status", run_id)["data"]

    def pids(self) -> dict:
        return json.loads((self.dir / "up.json").read_text())["services"]

    def queued(self) -> int:
        async def count():
            import nats

            nc = await nats.connect(self.env["ITO_NATS_URL"])
            try:
                return (await nc.jetstream().stream_info(f"{self.ns.upper()}_WORK")).state.messages
            finally:
                await nc.close()

        return asyncio.run(count())

    def down(self) -> None:
        self.cli("ito-training", "down", check=False)


def wait(predicate, timeout: float, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError("condition not reached")


def trainer_killed(root, nats_url, redis_url) -> dict:
    stack = Stack(root, nats_url, redis_url)
    try:
        run_id = stack.train(stack.booking(), stack.manifest(800), "kill-1")["data"]["run_id"]
        wait(lambda: (stack.status(run_id).get("last_checkpoint_step") or 0) >= 100, 120)
        killed_step = stack.status(run_id)["step"]
        os.kill(stack.pids()["trainer"], signal.SIGKILL)
        t0 = time.monotonic()
        wait(lambda: stack.status(run_id)["state"] == "interrupted", 60, 0.05)
        detected = time.monotonic() - t0
        replacement = subprocess.Popen([str(BIN / "ito-training"), "serve", "trainer"], env=stack.env,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait(lambda: stack.status(run_id)["state"] == "running" and stack.status(run_id)["step"] > 0, 90, 0.05)
            resumed = time.monotonic() - t0
            final = wait(lambda: (v := stack.status(run_id))["state"] in ("succeeded", "failed") and v, 300, 0.5)
            points = stack.ecc("metrics", run_id)["data"]["points"]
            steps = [p["step"] for p in points]
            restart = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
            lost = killed_step - (steps[restart] - 1)
        finally:
            replacement.terminate()
        return {"scenario": "trainer SIGKILL mid-stage", "detection_s": detected, "resume_s": resumed,
                "runs_lost": int(final["state"] != "succeeded"), "duplicate_runs": 0, "steps_lost": lost}
    finally:
        stack.down()


def scheduler_killed(root, nats_url, redis_url) -> dict:
    stack = Stack(root, nats_url, redis_url, "entitlement,confirmation,ledger,scheduler")
    try:
        pid = stack.pids()["scheduler"]
        os.kill(pid, signal.SIGTERM)
        time.sleep(1)
        crashing = subprocess.Popen([str(BIN / "ito-training"), "serve", "scheduler"],
                                    env={**stack.env, faults.ENV_FAULT_POINT: faults.SCHEDULER_AFTER_ACCEPT},
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait(lambda: stack.ecc("auth").get("ok"), 30)
        booking, manifest = stack.booking(), stack.manifest(10)
        answer = stack.train(booking, manifest, "crash-1")
        crashing.wait(timeout=10)
        t0 = time.monotonic()
        healthy = subprocess.Popen([str(BIN / "ito-training"), "serve", "scheduler"], env=stack.env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            view = wait(lambda: (o := stack.ecc("status", "--idempotency-key", "crash-1")).get("ok")
                        and o["data"]["state"] == "queued" and o["data"], 60, 0.1)
            resumed = time.monotonic() - t0
            queued = stack.queued()
        finally:
            healthy.terminate()
        return {"scenario": "scheduler SIGKILL after reservation", "detection_s": None, "resume_s": resumed,
                "runs_lost": int(not view), "duplicate_runs": max(0, queued - 1), "steps_lost": 0,
                "note": f"the CLI answered {answer.get('error', {}).get('code', 'ok')}"}
    finally:
        stack.down()


def restarted_during_burst(root, name: str) -> dict:
    state_dir = root / f"own-{name}"
    nats = infra.start_nats(state_dir, state_dir / "nats.log")
    redis = infra.start_redis(state_dir, state_dir / "redis.log")
    servers = {"nats": nats, "redis": redis}
    stack = Stack(root, nats.url, redis.url, CONTROL_PLANE)
    try:
        booking, manifest = stack.booking(), stack.manifest(10)
        text = manifest.read_text()
        digest = hashlib.sha256(manifest.read_bytes()).hexdigest()
        results, t_restart = asyncio.run(_burst_with_restart(stack, booking, text, digest, servers, state_dir, name))
        accepted = {k: out["data"]["run_id"] for k, out in results if out.get("ok")}
        found = {}
        for k, _ in results:
            out = stack.ecc("status", "--idempotency-key", k)
            if out.get("ok"):
                found[k] = out["data"]["run_id"]
        lost = sum(1 for k in accepted if found.get(k) != accepted[k])
        queued = wait(lambda: (q := stack.queued()) >= len(found) and q, 30, 0.5)
        return {"scenario": f"{name} restart during a burst", "detection_s": None, "resume_s": t_restart,
                "runs_lost": lost, "duplicate_runs": queued - len(set(found.values())), "steps_lost": 0,
                "note": f"{len(accepted)}/{len(results)} answered ok, {len(found)} runs"}
    finally:
        stack.down()
        for s in servers.values():
            infra.stop_pid(s.pid)


async def _burst_with_restart(stack, booking, text, digest, servers, state_dir, name):
    import nats

    nc = await nats.connect(stack.env["ITO_NATS_URL"], max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    cred = {"account": stack.account, "api_key": stack.key}

    async def call(suffix, **body):
        try:
            reply = await nc.request(f"{stack.ns}.{suffix}", json.dumps({"credential": cred, **body}).encode(),
                                     timeout=8)
            return json.loads(reply.data)
        except Exception as exc:  # the answer was lost in the outage
            return {"ok": False, "transport": type(exc).__name__}

    async def restart():
        await asyncio.sleep(1.0)
        started = servers[name]
        port = int(started.url.rsplit(":", 1)[1].split("/")[0])
        os.kill(started.pid, signal.SIGKILL)
        t0 = time.monotonic()
        await asyncio.sleep(1.0)
        start = infra.start_nats if name == "nats" else infra.start_redis
        servers[name] = await asyncio.to_thread(start, state_dir, state_dir / f"{name}.log", port)
        return time.monotonic() - t0

    restarter = asyncio.create_task(restart())
    results = []
    for i in range(60):
        conf = await call("v1.api.confirm", action="train", booking_id=booking, manifest_text=text,
                          manifest_digest=digest)
        if conf.get("ok"):
            out = await call("v1.api.train", booking_id=booking, manifest_text=text, manifest_digest=digest,
                             confirmation_ref=conf["data"]["confirmation_ref"], idempotency_key=f"b{i}")
        else:
            out = conf
        results.append((f"b{i}", out))
        await asyncio.sleep(0.05)
    t = await restarter
    await nc.close()
    return results, t


def fmt(value) -> str:
    return "-" if value is None else (f"{value:.1f}" if isinstance(value, float) else str(value))


def main() -> int:
    root = pathlib.Path(tempfile.mkdtemp(prefix="ito-chaos-"))
    own = root / "infra"
    nats = infra.start_nats(own, own / "nats.log")
    redis = infra.start_redis(own, own / "redis.log")
    rows = []
    try:
        scenarios = [("trainer SIGKILL mid-stage", lambda: trainer_killed(root, nats.url, redis.url)),
                     ("scheduler SIGKILL after reservation", lambda: scheduler_killed(root, nats.url, redis.url)),
                     ("nats restart during a burst", lambda: restarted_during_burst(root, "nats")),
                     ("redis restart during a burst", lambda: restarted_during_burst(root, "redis"))]
        for name, scenario in scenarios:
            try:
                rows.append(scenario())
            except Exception as exc:  # one failed scenario is reported, the others still run
                rows.append({"scenario": name, "error": f"{type(exc).__name__}: {exc}"[:200]})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        infra.stop_pid(nats.pid)
        infra.stop_pid(redis.pid)
    header = ("scenario", "detection_s", "resume_s", "runs_lost", "duplicate_runs", "steps_lost")
    print("\n" + " | ".join(header))
    for row in rows:
        print(" | ".join(fmt(row.get(h)) for h in header) + (f"  ({row['note']})" if row.get("note") else "")
              + (f"  ERROR {row['error']}" if row.get("error") else ""))
    out = REPO / "bench" / "chaos.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    return 1 if any(r.get("error") or r.get("runs_lost") or r.get("duplicate_runs") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
