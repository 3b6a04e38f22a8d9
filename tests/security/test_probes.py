"""The healthchecks compose.yaml runs, run here as written (only the port and the CA path moved):
a service's probe passes on a healthy HTTPS /healthz and fails on an unhealthy one; Redis' probe
passes on a server whose `default` user is off, without a password, and fails with no server."""

import asyncio
import pathlib
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from devstack.infra import free_port
from runtime.messaging.metrics import MetricsServer, ServiceMetrics, metrics_app
from runtime.security.tls import Certs

ROOT = pathlib.Path(__file__).resolve().parents[2]
SERVICES = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]


def service_probe(port: int, cafile: pathlib.Path) -> list[str]:
    cmd = list(SERVICES["scheduler"]["healthcheck"]["test"])
    assert cmd[:3] == ["CMD", "python", "-c"]
    code = (
        cmd[3].replace("127.0.0.1:9100", f"127.0.0.1:{port}").replace("/run/secrets/tls/ca.pem", str(cafile))
    )
    return [sys.executable, "-c", code]


async def test_the_service_probe_follows_healthz_over_https(tmp_path):
    certs = Certs(tmp_path / "tls")
    certs.ensure()
    state = {"ok": True}

    async def healthy() -> bool:
        return state["ok"]

    app = metrics_app(ServiceMetrics("scheduler").registry, "token", healthy)
    server = MetricsServer(app, "127.0.0.1", 0, certs.metrics_files())
    await server.start()
    try:

        async def probe() -> int:
            proc = await asyncio.create_subprocess_exec(
                *service_probe(server.port, certs.ca),
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
            return await asyncio.wait_for(proc.wait(), 30)

        assert await probe() == 0
        state["ok"] = False
        assert await probe() != 0  # 503: urlopen raises, the probe exits 1
    finally:
        await server.stop()
    assert await probe() != 0  # nothing listening


def redis_probe(port: int) -> str:
    (kind, script) = SERVICES["redis"]["healthcheck"]["test"]
    assert kind == "CMD-SHELL" and "redis-cli -h 127.0.0.1 ping" in script
    return script.replace("redis-cli -h 127.0.0.1", f"redis-cli -h 127.0.0.1 -p {port}")


@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="no redis-cli here")
def test_the_redis_probe_needs_no_password_and_fails_without_a_server(tmp_path):
    acl = tmp_path / "redis.acl"
    acl.write_text("user default off\n")
    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--aclfile", str(acl)],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while subprocess.run(["sh", "-c", redis_probe(port)], timeout=10).returncode != 0:
            assert time.monotonic() < deadline, "the probe never passed"
            time.sleep(0.1)
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert subprocess.run(["sh", "-c", redis_probe(port)], timeout=10).returncode != 0
