"""deploy/k8s/ is valid Kubernetes and keeps the zero-trust shape: every object validates against
the Kubernetes JSON schemas (kubernetes-validate, bundled offline, strict: no unknown field); the
control plane runs two replicas of each service, NATS and Redis are StatefulSets, the trainer is a
DaemonSet on GPU nodes asking for `nvidia.com/gpu`; each pod mounts only its own identity's Secret;
every pod is non-root on a read-only root filesystem with probes; and the NetworkPolicies, evaluated
here with Kubernetes' rules, keep the rendezvous ports between trainer pods."""

import pathlib
import re

import kubernetes_validate
import pytest
import yaml

from runtime.security.identities import REDIS_SERVICES, SERVICE_IDENTITIES

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy/k8s"
KUSTOMIZATION = yaml.safe_load((K8S / "kustomization.yaml").read_text())
KUBERNETES_VERSION = "1.33"  # the oldest minor the manifests target (NetworkPolicy endPort: 1.25+)
DOCS = [
    (path.name, doc)
    for path in sorted(K8S.glob("*.yaml"))
    if path.name != "kustomization.yaml"
    for doc in yaml.safe_load_all(path.read_text())
]
BY_KIND: dict[tuple[str, str], dict] = {(d["kind"], d["metadata"]["name"]): d for _, d in DOCS}
WORKLOADS = {k: d for k, d in BY_KIND.items() if k[0] in ("Deployment", "StatefulSet", "DaemonSet")}
POLICIES = [d for _, d in DOCS if d["kind"] == "NetworkPolicy"]
NAMESPACE = "ito"


@pytest.mark.parametrize(
    ("name", "doc"), DOCS, ids=[f"{n}:{d['kind']}/{d['metadata']['name']}" for n, d in DOCS]
)
def test_every_object_validates_against_the_kubernetes_schema(name, doc):
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validator_refuses_a_broken_object():  # the check above can fail
    broken = yaml.safe_load(yaml.safe_dump(BY_KIND["Deployment", "scheduler"]))
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
    broken = yaml.safe_load(yaml.safe_dump(BY_KIND["DaemonSet", "trainer"]))
    broken["spec"]["template"]["spec"]["containers"][0]["gpus"] = 8  # no such field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_kustomization_applies_every_manifest_in_one_namespace():
    assert sorted(KUSTOMIZATION["resources"]) == sorted({n for n, _ in DOCS})
    assert KUSTOMIZATION["namespace"] == NAMESPACE
    assert all(
        d["metadata"].get("namespace", NAMESPACE) == NAMESPACE for _, d in DOCS if d["kind"] != "Namespace"
    )


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def test_the_control_plane_runs_two_replicas_of_every_service_and_the_infra_as_statefulsets():
    for name in SERVICE_IDENTITIES:
        if name == "trainer":
            continue
        d = BY_KIND["Deployment", name]
        assert d["spec"]["replicas"] == 2, name
        (c,) = pod_spec(d)["containers"]
        assert c["args"] == ["serve", name]
        env = {e["name"]: e for e in c["env"]}
        assert env["ITO_INSTANCE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"  # one name each
        assert BY_KIND["PodDisruptionBudget", name]["spec"]["maxUnavailable"] == 1
    for name in ("nats", "redis"):
        s = BY_KIND["StatefulSet", name]
        assert s["spec"]["volumeClaimTemplates"], name  # JetStream's store, the AOF: on a volume
    redis = pod_spec(BY_KIND["StatefulSet", "redis"])["containers"][0]["args"]
    assert "--aclfile" in redis and redis[redis.index("--appendfsync") + 1] == "always"


def test_the_trainer_is_a_daemonset_on_gpu_nodes_with_gpu_requests():
    t = BY_KIND["DaemonSet", "trainer"]
    spec = pod_spec(t)
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert any(tol["key"] == "nvidia.com/gpu" for tol in spec["tolerations"])
    (c,) = spec["containers"]
    assert c["args"] == ["serve", "trainer"] and c["image"].startswith("ito-training-cuda:")
    gpus = c["resources"]["requests"]["nvidia.com/gpu"]
    assert int(gpus) >= 1 and c["resources"]["limits"]["nvidia.com/gpu"] == gpus  # extended: equal
    for d in WORKLOADS.values():  # no GPU anywhere else
        if d is not t:
            assert "nvidia.com/gpu" not in str(d), d["metadata"]["name"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert (
        volumes[mounts["/data"]]["persistentVolumeClaim"]["claimName"] == "ito-data"
    )  # shared with the scheduler
    claim = BY_KIND["PersistentVolumeClaim", "ito-data"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def gibibytes(quantity: str) -> float:
    number, unit = re.fullmatch(r"(\d+)([KMGT]i)", quantity).groups()  # type: ignore[union-attr]
    return int(number) * 1024 ** "KMGT".index(unit[0]) / 1024**2


def test_the_trainer_keeps_its_compile_caches_on_a_volume_sized_for_them():
    """Inductor's and Triton's caches (a few GB) on their own volume, not in the 1 Gi /tmp; the same
    directories as the trainer image's (the Dockerfile's `trainer` stage)."""
    spec = pod_spec(BY_KIND["DaemonSet", "trainer"])
    (c,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    image = (ROOT / "Dockerfile").read_text()
    for variable in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        path = env[variable]
        assert f"{variable}={path}" in image, variable
        (mount,) = [m for m in mounts if path.startswith(m.rstrip("/") + "/")]
        assert mount != "/tmp", variable
        cache = volumes[mounts[mount]]["emptyDir"]
        assert gibibytes(cache["sizeLimit"]) >= 8, cache
        assert gibibytes(cache["sizeLimit"]) > gibibytes(volumes[mounts["/tmp"]]["emptyDir"]["sizeLimit"])


def test_only_the_trainer_adds_a_capability_and_it_is_ipc_lock():
    for (_kind, name), d in WORKLOADS.items():
        for c in pod_spec(d).get("initContainers", []) + pod_spec(d)["containers"]:
            added = c["securityContext"]["capabilities"].get("add", [])
            want = ["IPC_LOCK"] if (name, c["name"]) == ("trainer", "trainer") else []
            assert added == want, (name, c["name"], added)  # NCCL over InfiniBand pins memory


def test_every_pod_is_non_root_read_only_and_probed():
    for (kind, name), d in WORKLOADS.items():
        spec = pod_spec(d)
        sec = spec["securityContext"]
        assert sec["runAsNonRoot"] is True and sec["runAsUser"] != 0, name
        assert spec["automountServiceAccountToken"] is False, name
        for c in spec.get("initContainers", []) + spec["containers"]:
            cs = c["securityContext"]
            assert cs["readOnlyRootFilesystem"] is True and cs["allowPrivilegeEscalation"] is False, (
                name,
                c["name"],
            )
            assert cs["capabilities"]["drop"] == ["ALL"], (name, c["name"])
        for c in spec["containers"]:
            assert c.get("readinessProbe") and c.get("livenessProbe"), (kind, name)
            assert "/run/secrets" not in str(c["readinessProbe"]), name  # a probe needs no credential


def secret_files(identity: str) -> set[str]:
    """The paths under /run/secrets a service's pod gets, from the Secrets it projects."""
    d = BY_KIND["DaemonSet" if identity == "trainer" else "Deployment", identity]
    (projected,) = [v["projected"] for v in pod_spec(d)["volumes"] if "projected" in v]
    out = set()
    for source in projected["sources"]:
        secret = source["secret"]
        generated = {g["name"]: g for g in KUSTOMIZATION["secretGenerator"]}[secret["name"]]
        keys = {f.split("=")[0]: f.split("=")[1] for f in generated["files"]}
        for item in secret["items"]:
            assert item["key"] in keys, (identity, secret["name"], item["key"])
            out.add(item["path"])
    return out


def test_each_pod_mounts_only_its_own_identitys_secret():
    for name in SERVICE_IDENTITIES:
        mine = secret_files(name)
        assert {p for p in mine if p.startswith("nats/")} == {f"nats/{name}.nk"}, name
        assert {p for p in mine if p.startswith("redis/")} == (
            {f"redis/{name}.pw"} if name in REDIS_SERVICES else set()
        )
        assert ("signing/scheduler.ed25519" in mine) == (name == "scheduler"), name
        assert ("entitlement_key" in mine) == (name in ("entitlement", "scheduler")), name
        assert "tokens/metrics.token" in mine and "signing/scheduler.pub" in mine
    generated = {g["name"]: g["files"] for g in KUSTOMIZATION["secretGenerator"]}
    for name in SERVICE_IDENTITIES:  # an identity's Secret holds its own files only
        assert all(f"/{name}." in f or f.endswith(f"/{name}.nk") for f in generated[f"ito-{name}"]), name
        if name != "scheduler":
            assert not any("signing" in f for f in generated[f"ito-{name}"])


# --- NetworkPolicy, evaluated as Kubernetes does (same-namespace peers unless a namespaceSelector) ---

PODS = {  # (namespace, labels) of one pod of each kind
    name: (NAMESPACE, pod_spec_labels)
    for (kind, name), d in WORKLOADS.items()
    for pod_spec_labels in [d["spec"]["template"]["metadata"]["labels"]]
}
PODS["prometheus"] = ("monitoring", {"app.kubernetes.io/name": "prometheus"})
PODS["outsider"] = ("default", {"app": "anything"})
PODS["tenant-pod-in-ns"] = (NAMESPACE, {"app": "debug"})
NS_LABELS = {ns: {"kubernetes.io/metadata.name": ns} for ns in (NAMESPACE, "monitoring", "default")}


def matches(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # what these manifests use
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def peer_matches(peer: dict, policy_ns: str, pod: str) -> bool:
    ns, labels = PODS[pod]
    if "namespaceSelector" in peer:
        if not matches(peer["namespaceSelector"], NS_LABELS[ns]):
            return False
    elif ns != policy_ns:
        return False
    return matches(peer.get("podSelector", {}), labels)


def port_matches(ports: list[dict] | None, port: int) -> bool:
    if not ports:
        return True
    return any(
        p.get("protocol", "TCP") == "TCP" and p["port"] <= port <= p.get("endPort", p["port"]) for p in ports
    )


def allowed_direction(direction: str, here: str, there: str, port: int) -> bool:
    ns, labels = PODS[here]
    selecting = [
        p
        for p in POLICIES
        if p["metadata"]["namespace"] == ns
        and matches(p["spec"]["podSelector"], labels)
        and direction in p["spec"]["policyTypes"]
    ]
    if not selecting:
        return True  # not isolated in that direction
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    for p in selecting:
        for rule in p["spec"].get(key, []):
            peers = rule.get(peers_key)
            if (peers is None or any(peer_matches(peer, ns, there) for peer in peers)) and port_matches(
                rule.get("ports"), port
            ):
                return True
    return False


def allowed(src: str, dst: str, port: int) -> bool:
    return allowed_direction("Egress", src, dst, port) and allowed_direction("Ingress", dst, src, port)


RENDEZVOUS_PORT = 29500  # any port the scheduler picks for a run's store, Lighthouse or collectives


@pytest.mark.parametrize(
    ("src", "dst", "port", "ok"),
    [
        ("trainer", "trainer", RENDEZVOUS_PORT, True),
        ("trainer", "trainer", 47311, True),
        ("scheduler", "trainer", RENDEZVOUS_PORT, False),
        ("nats", "trainer", RENDEZVOUS_PORT, False),
        ("tenant-pod-in-ns", "trainer", RENDEZVOUS_PORT, False),
        ("outsider", "trainer", RENDEZVOUS_PORT, False),
        ("prometheus", "trainer", RENDEZVOUS_PORT, False),
        ("trainer", "scheduler", RENDEZVOUS_PORT, False),
        ("trainer", "outsider", RENDEZVOUS_PORT, False),
        ("prometheus", "trainer", 9100, True),
        ("prometheus", "scheduler", 9100, True),
        ("outsider", "scheduler", 9100, False),
        ("trainer", "nats", 4222, True),
        ("scheduler", "nats", 4222, True),
        ("outsider", "nats", 4222, True),  # tenants' ecc: the client port (every connection needs an nkey)
        ("outsider", "nats", 8222, False),  # no monitoring
        ("scheduler", "redis", 6379, True),
        ("ledger", "redis", 6379, True),
        ("trainer", "redis", 6379, False),  # the trainer has no Redis identity
        ("tenant-pod-in-ns", "redis", 6379, False),
        ("scheduler", "ledger", 9100, False),
    ],
)
def test_network_policies(src, dst, port, ok):
    assert allowed(src, dst, port) == ok


def test_tls_is_on_nats_alone_holds_the_server_key_and_no_ca_key_is_anywhere():
    for name in SERVICE_IDENTITIES:
        d = BY_KIND["DaemonSet" if name == "trainer" else "Deployment", name]
        (c,) = pod_spec(d)["containers"]
        assert {e["name"]: e.get("value") for e in c["env"]}["ITO_TLS"] == "1", name
        mine = secret_files(name)
        assert {"tls/ca.pem", "tls/metrics.pem", "tls/metrics.key"} <= mine, name
        assert "tls/server.key" not in mine, name
        assert c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS", name  # /metrics' port is HTTPS only
    nats = pod_spec(BY_KIND["StatefulSet", "nats"])
    (tls,) = [v for v in nats["volumes"] if v["name"] == "tls"]
    assert {i["path"] for s in tls["projected"]["sources"] for i in s["secret"]["items"]} == {
        "ca.pem",
        "server.pem",
        "server.key",
    }
    mounts = {m["name"]: m["mountPath"] for m in nats["containers"][0]["volumeMounts"]}
    assert mounts["tls"] == "/run/secrets/tls"  # where the generated nats.conf's `tls {}` points
    files = [f for g in KUSTOMIZATION["secretGenerator"] for f in g["files"]]
    assert not any(f.endswith("ca.key") for f in files)
