"""compose.yaml is ready for GPU nodes: every container runs as an unprivileged user on a read-only
root filesystem, has a healthcheck and starts once what it needs is healthy; the trainers take the
CUDA image and reserve the node's NVIDIA GPUs; Prometheus scrapes every /metrics through file_sd
with the metrics token as its bearer credentials file. Checked by parsing (no Docker engine here);
`docker-compose config -q` runs too where a compose binary is installed."""

import json
import pathlib
import re
import shutil
import subprocess

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
PROMETHEUS = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
ONE_SHOT = {name for name, spec in SERVICES.items() if spec.get("restart") == "no"}
LONG_RUNNING = set(SERVICES) - ONE_SHOT
TRAINERS = {name for name, spec in SERVICES.items() if spec.get("command") == ["serve", "trainer"]}


def interpolated(value: str) -> str:
    """`${VAR:-default}` as compose reads it with VAR unset."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def test_every_container_runs_as_an_unprivileged_user():
    for name, spec in SERVICES.items():
        assert "user" in spec, name
        uid, _, gid = interpolated(str(spec["user"])).partition(":")
        assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0, (name, spec["user"])
    # the images' own default user is the same unprivileged one
    for dockerfile in ["Dockerfile", *map(str, (ROOT / "deploy/images").glob("*.Dockerfile"))]:
        users = [
            line.split()[1]
            for line in (ROOT / dockerfile).read_text().splitlines()
            if line.startswith("USER ")
        ]
        assert users and users[-1] not in ("root", "0", "0:0"), dockerfile


def test_every_root_filesystem_is_read_only_with_a_tmpfs_tmp_and_no_capabilities():
    for name, spec in SERVICES.items():
        assert spec.get("read_only") is True, name
        assert "/tmp" in spec.get("tmpfs", []), name
        assert spec.get("cap_drop") == ["ALL"] and "no-new-privileges:true" in spec.get("security_opt", []), (
            name
        )


def test_every_long_running_service_has_a_healthcheck_with_no_secret_in_it():
    for name in LONG_RUNNING:
        check = SERVICES[name].get("healthcheck")
        assert check and check["test"][0] in ("CMD", "CMD-SHELL") and not check.get("disable"), name
        text = json.dumps(check).replace("/run/secrets/tls/ca.pem", "")  # the CA certificate is public
        assert "/run/secrets" not in text and "REDISCLI_AUTH" not in text, name
    for target in metrics_targets():  # a service's probe asks its own /healthz on its metrics port
        name, port = target.split(":")
        probe = " ".join(SERVICES[name]["healthcheck"]["test"])
        assert f"https://127.0.0.1:{port}/healthz" in probe and "cafile='/run/secrets/tls/ca.pem'" in probe, (
            name
        )


def test_depends_on_waits_for_health_or_for_a_finished_job():
    waited = 0
    for name, spec in SERVICES.items():
        deps = spec.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: depends_on without conditions"
        for dep, cond in deps.items():
            want = "service_completed_successfully" if dep in ONE_SHOT else "service_healthy"
            assert cond == {"condition": want}, (name, dep, cond)
            waited += 1
    assert waited > len(SERVICES)  # the services do wait for their infra (not vacuous)


def test_the_trainers_reserve_nvidia_gpus_and_take_the_cuda_image():
    assert TRAINERS == {"trainer", "trainer-1", "trainer-2"}
    for name in TRAINERS:
        spec = SERVICES[name]
        devices = spec["deploy"]["resources"]["reservations"]["devices"]
        assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices), name
        assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d+", spec["build"]["args"]["TORCH_INDEX"])
        assert spec["image"] != SERVICES["scheduler"]["image"]
    for name in set(SERVICES) - TRAINERS:  # the control plane: no GPU, the CPU wheel
        assert "deploy" not in SERVICES[name], name
        assert "TORCH_INDEX" not in SERVICES[name].get("build", {}).get("args", {}), name
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in dockerfile
    assert '--index-url "${TORCH_INDEX}" torch==2.13.0' in dockerfile


def dockerfile_stages() -> dict[str, str]:
    """The Dockerfile's instructions per named stage (`FROM ... AS name`; an unnamed stage is
    `FROM base`), comments left out."""
    stages: dict[str, str] = {}
    name = ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("FROM "):
            words = line.split()
            name = words[3] if len(words) > 3 and words[2].upper() == "AS" else f"FROM {words[1]}"
            stages[name] = ""
        elif name and not line.lstrip().startswith("#"):
            stages[name] += line + "\n"
    return stages


def stage_env(stage: str) -> dict[str, str]:
    env = {}
    for line in stage.splitlines():
        if line.startswith("ENV "):
            env |= dict(pair.split("=", 1) for pair in line.split()[1:] if "=" in pair)
    return env


def test_the_trainer_image_has_a_c_compiler_and_keeps_its_compile_caches_on_a_volume():
    """torch.compile (Inductor's C++, Triton's kernels) needs a C compiler, which python:3.11-slim
    lacks; the control plane's image stays without one. The caches go to a named volume, not /tmp."""
    stages = dockerfile_stages()
    assert "build-essential" in stages["trainer"] and "apt-get install" in stages["trainer"]
    assert "build-essential" not in stages["service"] and "gcc" not in stages["service"]
    assert list(stages)[-1] == "FROM service"  # `docker build .` is the control plane's image
    env = stage_env(stages["trainer"])
    caches = {env["TORCHINDUCTOR_CACHE_DIR"], env["TRITON_CACHE_DIR"]}
    assert not any(c.startswith("/tmp") for c in caches), caches
    for name in TRAINERS:
        assert SERVICES[name]["build"]["target"] == "trainer", name
        mounts = {v.split(":")[1]: v.split(":")[0] for v in SERVICES[name]["volumes"]}
        for cache in caches:
            (volume,) = {src for dst, src in mounts.items() if cache.startswith(dst.rstrip("/") + "/")}
            assert volume in COMPOSE["volumes"], (name, cache)  # a named volume: kept across restarts
    for name in set(SERVICES) - TRAINERS:
        assert SERVICES[name].get("build", {}).get("target") in (None, "service"), name


def test_only_the_trainers_pin_memory_share_ipc_memory_and_reach_infiniband():
    """NCCL over InfiniBand: unlimited locked memory, IPC_LOCK, /dev/infiniband, a large /dev/shm,
    for the trainers and for nothing else (every other container keeps no capability)."""
    for name in TRAINERS:
        spec = SERVICES[name]
        assert spec["ulimits"]["memlock"] == {"soft": -1, "hard": -1}, name
        assert spec["cap_add"] == ["IPC_LOCK"] and spec["cap_drop"] == ["ALL"], name
        assert "/dev/infiniband:/dev/infiniband" in spec["devices"], name
        size = re.fullmatch(r"(\d+)gb", spec["shm_size"])
        assert size and int(size.group(1)) >= 8, (name, spec["shm_size"])
    for name in set(SERVICES) - TRAINERS:
        spec = SERVICES[name]
        assert not {"cap_add", "ulimits", "devices", "ipc", "privileged"} & set(spec), name


def metrics_targets() -> set[str]:
    """host:port of every /metrics the stack serves: each service's ITO_METRICS_PORT, the desk's."""
    out = {"desk:8765"}  # the desk app serves its /metrics on its own port
    for name, spec in SERVICES.items():
        if spec.get("command", [None])[0] == "serve":
            out.add(f"{name}:{spec['environment']['ITO_METRICS_PORT']}")
    return out


def test_prometheus_scrapes_every_metrics_endpoint_with_the_token_file():
    prom = SERVICES["prometheus"]
    assert prom["healthcheck"] and prom["ports"] == ["127.0.0.1:9090:9090"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in prom["volumes"] if v.startswith("./")}
    assert mounts["/etc/prometheus/prometheus.yml"] == "./deploy/prometheus/prometheus.yml"
    assert prom["secrets"] == [
        {"source": "metrics_token", "target": "metrics_token"},
        {"source": "tls_ca", "target": "tls_ca"},
    ]
    assert COMPOSE["secrets"]["metrics_token"] == {"file": "./.ito/secrets/tokens/metrics.token"}
    (job,) = PROMETHEUS["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["scheme"] == "https" and job["tls_config"] == {"ca_file": "/run/secrets/tls_ca"}  # verified
    assert job["authorization"] == {"type": "Bearer", "credentials_file": "/run/secrets/metrics_token"}
    (sd,) = job["file_sd_configs"]
    (pattern,) = sd["files"]
    host_dir = mounts[str(pathlib.PurePosixPath(pattern).parent)]
    listed = set()
    for path in (ROOT / host_dir).glob(pathlib.PurePosixPath(pattern).name):
        for group in json.loads(path.read_text()):
            assert group["labels"]["service"]
            listed |= set(group["targets"])
    assert listed == metrics_targets()
    assert len(listed) == 6 * 3 + 1  # six services, single and two cluster instances, and the desk


def test_every_scraped_service_mounts_the_metrics_token():
    for target in metrics_targets():
        name = target.split(":")[0]
        mounted = {s if isinstance(s, str) else s["target"] for s in SERVICES[name].get("secrets", [])}
        assert "tokens/metrics.token" in mounted, name
        if name != "desk":
            assert SERVICES[name]["environment"]["ITO_METRICS_HOST"] == "0.0.0.0"  # reachable by Prometheus
            # HTTPS with the metrics certificate (the services' names), never NATS' server key
            assert {"tls/metrics.pem", "tls/metrics.key"} <= mounted and "tls/server.key" not in mounted, name


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="no docker-compose binary here")
def test_compose_config_is_valid():
    subprocess.run(
        ["docker-compose", "-f", str(ROOT / "compose.yaml"), "config", "-q"], check=True, timeout=60
    )
