"""Settings from the environment: every env-var name and its default, in one place, and the few
types a setting's value parses into (`StoreUrl`: where checkpoints and exports may live).

Every other module imports a name from here, never spells it (tests/house/test_settings_home.py);
the few the client reads too are written in contracts/environment.py and taken over below."""

import os
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlparse

from contracts import environment

# The names the client (`ecc`) reads too live in contracts (ecc imports only contracts); they are
# settings' own constants all the same.
ENV_NATS_URL = environment.ENV_NATS_URL
ENV_NAMESPACE = environment.ENV_NAMESPACE
ENV_NATS_CA = environment.ENV_NATS_CA  # ecc: the CA file that signed the NATS server's certificate
ENV_REDIS_URL = "ITO_REDIS_URL"
ENV_REDIS_CLUSTER = "ITO_REDIS_CLUSTER"
ENV_DATA_DIR = "ITO_DATA_DIR"
ENV_MODEL_STORE = "ITO_MODEL_STORE"  # base models and tokenizers (runtime/storage/model_store.py)
ENV_SECRETS_DIR = "ITO_SECRETS_DIR"
ENV_ENTITLEMENT_KEY = "ITO_ENTITLEMENT_KEY"
ENV_ENTITLEMENT_KEY_FILE = "ITO_ENTITLEMENT_KEY_FILE"
ENV_CONFIRMATION_TTL_S = "ITO_CONFIRMATION_TTL_S"
ENV_ELIGIBILITY_TTL_S = "ITO_ELIGIBILITY_TTL_S"
ENV_IDEMPOTENCY_RETENTION_S = "ITO_IDEMPOTENCY_RETENTION_S"
ENV_REQUEST_TIMEOUT_S = "ITO_REQUEST_TIMEOUT_S"
ENV_TRAINER_THREADS = "ITO_TRAINER_THREADS"
# Per-block torch.compile of every stage's model: "auto" (on for cuda, off on CPU), "on" or "off"
# (off when a compile misbehaves on a GPU; on to try it on CPU). training/engine/speed.py.
ENV_TRAINER_COMPILE = "ITO_TRAINER_COMPILE"
ENV_PLAN_SMALL_MODEL_GANGS = "ITO_PLAN_SMALL_MODEL_GANGS"
ENV_RENDEZVOUS_HOST = "ITO_RENDEZVOUS_HOST"
ENV_NATS_REPLICAS = "ITO_NATS_REPLICAS"
ENV_INSTANCE = "ITO_INSTANCE"
ENV_DESK_PORT = "ITO_DESK_PORT"  # the desk app's port under `up --desk` (default 8765 when free)
ENV_METRICS_PORT = "ITO_METRICS_PORT"
ENV_METRICS_HOST = "ITO_METRICS_HOST"
ENV_TLS = (
    "ITO_TLS"  # "1": NATS, the desk and /metrics speak TLS with <secrets dir>/tls (runtime/security/tls.py)
)
ENV_FILE_STORE_URL = "ITO_FILE_STORE_URL"  # the tenant store (runtime/storage/tenant_files.py)
ENV_FILE_ROOT = "ITO_FILE_ROOT"  # where `file:` data refs may point: <root>/<account>/...; unset: nowhere
ENV_CHECKPOINT_ROOTS = "ITO_CHECKPOINT_ROOTS"  # absolute dirs a manifest's checkpoint.storage may name
ENV_UPLOAD_TTL_S = "ITO_UPLOAD_TTL_S"
ENV_CHECKPOINT_URL = "ITO_CHECKPOINT_URL"  # "", a path, file:///path or s3://bucket/prefix
ENV_S3_ENDPOINT_URL = "ITO_S3_ENDPOINT_URL"  # an S3-compatible store that is not AWS; "" for AWS
ENV_GANG_MAX_REQUEUES = "ITO_GANG_MAX_REQUEUES"  # how often a run's gang lost past its restarts is requeued
ENV_GANG_MAX_RESTARTS = "ITO_GANG_MAX_RESTARTS"  # how often the elastic launcher restarts a lost gang
ENV_NODE_HOST = "ITO_NODE_HOST"  # where this node's replica group store is reached (multinode runs)
# The operator switch that let several GPUs per node on several nodes train while such plans were
# refused by default (a late group's heal from its peer failed with FSDP2 state; fixed in
# fault_tolerance: a synchronous quorum, local shards). They train by default now; the variable is
# still accepted and changes nothing (training/launch/multinode.py).
ENV_MULTINODE_GANGS = "ITO_MULTINODE_GANGS"
ENV_FAULT_POINT = "ITO_FAULT_POINT"  # chaos tests only: a fault point's name (configuration/faults.py)
ENV_FAULT_SPIKE_STEP = "ITO_FAULT_SPIKE_STEP"  # trainer.loss_spike: losses reported x10 from this step on
ENV_FAULT_STEP_DELAY_S = "ITO_FAULT_STEP_DELAY_S"  # trainer.slow_steps: every step takes this much longer
ENV_SUITE_TIMES_DIR = "ITO_SUITE_TIMES_DIR"  # bench/suite_times.py's plugin writes its records here when set
EMBEDDED_FILE_ROOT = "file-root"  # `ito-training up` sets ITO_FILE_ROOT to <data dir>/file-root unless set

DEFAULT_NATS_URL = environment.DEFAULT_NATS_URL  # or a comma-separated list: a cluster's server pool
DEFAULT_NATS_REPLICAS = 1  # 3 on a 3-node cluster (`ito-training up --cluster`): every stream R3
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_NAMESPACE = environment.DEFAULT_NAMESPACE
DEFAULT_DATA_DIR = ".ito"  # relative to the working directory; state of embedded infra and runs
DEFAULT_CONFIRMATION_TTL_S = 600.0  # short on purpose: a confirmation is a fresh human decision
DEFAULT_ELIGIBILITY_TTL_S = 60.0  # a statement is re-fetched when older, never stretched
DEFAULT_IDEMPOTENCY_RETENTION_S = 7 * 24 * 3600.0  # a retried request within a week replays
DEFAULT_REQUEST_TIMEOUT_S = 2.0  # one internal hop; the CLI's overall timeout is larger
DEFAULT_RENDEZVOUS_HOST = (
    "127.0.0.1"  # node 0's address as the other nodes reach it; a routable one across hosts
)

DEFAULT_UPLOAD_TTL_S = 24 * 3600.0  # an upload not committed by then is removed and its quota given back
DEFAULT_METRICS_PORT = 0  # no /metrics endpoint; `ito-training up` gives each service a free port
DEFAULT_METRICS_HOST = "127.0.0.1"  # loopback; a container's address where Prometheus runs elsewhere
DEFAULT_GANG_MAX_REQUEUES = 2  # a gang lost past its restarts comes back twice (a bad node, a
# preempted neighbour); a crash that repeats on every delivery then fails the run instead of looping
DEFAULT_GANG_MAX_RESTARTS = 2  # a rank lost to a node hiccup is restarted twice; a third loss
# interrupts the run (requeued, resumed from the last checkpoint)
DEFAULT_NODE_HOST = "127.0.0.1"  # where this node's replica group store is reached; routable across hosts
DEFAULT_FAULT_SPIKE_STEP = 60
DEFAULT_FAULT_STEP_DELAY_S = 1.0  # a run that costs more than its estimate (tests/e2e/test_budget.py)

MAX_REQUEST_BYTES = 2 * 1024 * 1024  # an API request; the manifest inside is capped at 1 MiB


def trainer_threads(environ: Mapping[str, str], cpus: int) -> int:
    """Torch threads for a trainer agent: ITO_TRAINER_THREADS, else the OMP_NUM_THREADS it was
    given (torch's own knob: a process started with it trains with it), else `cpus` (the cores
    this process may run on); at least one. ValueError names a variable that is not a count."""
    for name in (ENV_TRAINER_THREADS, "OMP_NUM_THREADS"):
        value = environ.get(name, "").strip()
        if value:
            try:
                return max(1, int(value))
            except ValueError:
                raise ValueError(f"{name} must be a whole number of threads, not {value!r}") from None
    return max(1, cpus)


TRAINER_COMPILE_CHOICES = {"auto": None, "on": True, "off": False}


def trainer_compile(environ: Mapping[str, str]) -> bool | None:
    """ITO_TRAINER_COMPILE as the stages' `Speed.compile`: None for "auto" (or unset), True for
    "on", False for "off". ValueError names any other value."""
    value = environ.get(ENV_TRAINER_COMPILE, "").strip().lower() or "auto"
    if value not in TRAINER_COMPILE_CHOICES:
        raise ValueError(f"{ENV_TRAINER_COMPILE} needs to be auto, on or off, not {value!r}.")
    return TRAINER_COMPILE_CHOICES[value]


def usable_cpus() -> int:
    """The cores this process may run on (its affinity: a container's limit), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _float(env: dict[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    value = float(raw)
    if value <= 0:
        raise ValueError(f"{name} needs to be a positive number of seconds, got {raw!r}.")
    return value


def _port(env: dict[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} needs to be a port number (0: none), got {raw!r}.") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    nats_url: str
    """NATS server (JetStream on) that carries every request and event; several, comma-separated,
    for a cluster (the clients' server pool: `nats_servers`)."""
    redis_url: str
    """Redis holding confirmations, idempotency reservations, projections and run records. With
    `redis_cluster`, one or more of the cluster's nodes, comma-separated (the client finds the rest)."""
    namespace: str
    """Prefix of every subject, stream and Redis key; tests use a unique one per run."""
    data_dir: pathlib.Path
    """Embedded infra state, logs, checkpoints."""
    secrets_dir: pathlib.Path
    """Credentials, one 0600 file each (runtime/security/secrets.py); default `<data_dir>/secrets`."""
    model_store_dir: pathlib.Path | None = None
    """The model store (`ITO_MODEL_STORE`); None: `<data_dir>/models` (`model_store`)."""
    confirmation_ttl_s: float
    eligibility_ttl_s: float
    idempotency_retention_s: float
    request_timeout_s: float
    small_model_gangs: bool = False
    """Plan a model too small to need several GPUs on the GPUs of one node anyway (tests and demos
    of the gang on CPU, where each "GPU" is a process). Off in production: it only adds traffic."""
    rendezvous_host: str = DEFAULT_RENDEZVOUS_HOST
    """Where a multi-node run's node 0 hosts its rendezvous store (the scheduler picks the port)."""
    redis_cluster: bool = False
    """`redis_url` names the nodes of a Redis Cluster (`ITO_REDIS_CLUSTER=1`): the services speak to
    it with redis-py's cluster client, which follows slot moves and failovers by itself."""
    nats_replicas: int = DEFAULT_NATS_REPLICAS
    """Replicas of every JetStream stream (the operator declares them with this); at most the
    number of JetStream servers in the cluster."""
    instance: str = ""
    """This process's name among several instances of its service (`scheduler-2`); "" for one."""
    metrics_port: int = DEFAULT_METRICS_PORT
    """Where this process serves Prometheus' `/metrics` (runtime/messaging/metrics.py, bearer token
    required); 0: not at all."""
    metrics_host: str = DEFAULT_METRICS_HOST
    """The address `/metrics` listens on."""
    tls: bool = False
    """NATS (client and route listeners), the desk and every `/metrics` speak TLS with the
    certificates under `tls_dir` (`ITO_TLS=1`, `ito-training up --tls`, compose); the services verify
    the NATS server against its `ca.pem`. Off: plain, for a stack on loopback only."""
    checkpoint_url: str = ""
    """Where checkpoints and exports may also live (`ITO_CHECKPOINT_URL`): "" for
    `<data_dir>/checkpoints`, a shared path, or `s3://bucket/prefix` (runtime/storage/checkpoint_store.py)."""
    file_store_url: str = ""
    """The tenant store, where uploads and files live (`ITO_FILE_STORE_URL`): "" for
    `<data_dir>/tenant-files`, an absolute path, or `s3://bucket/prefix` (runtime/storage/tenant_files.py)."""
    file_root: pathlib.Path | None = None
    """Where `file:` data refs may point (`ITO_FILE_ROOT`): account A's are below `<root>/A/`,
    opened from the root down with O_NOFOLLOW. None (the default): `file:` refs are refused, a
    tenant uploads its data. `ito-training up` (the embedded development stack) sets
    `<data_dir>/file-root` unless told otherwise."""
    checkpoint_roots: tuple[pathlib.Path, ...] = ()
    """The absolute directories a manifest's `checkpoint.storage` may name (`ITO_CHECKPOINT_ROOTS`,
    separated by ':'); none: only "local". A run's directory below one is made from the root down
    with O_NOFOLLOW, so a link in it is refused, never followed."""
    upload_ttl_s: float = DEFAULT_UPLOAD_TTL_S
    """How long an upload may stay uncommitted before it is removed and its quota given back."""
    s3_endpoint_url: str = ""
    """The endpoint of an S3-compatible store that is not AWS (MinIO, Ceph RGW, R2...:
    `ITO_S3_ENDPOINT_URL`), for `s3://` checkpoint and tenant stores; "" for AWS."""

    def __post_init__(self) -> None:
        if not self.namespace.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"The namespace must be letters, digits, '-' or '_', got {self.namespace!r}.")
        if not 1 <= self.nats_replicas <= 5:
            raise ValueError(f"Stream replicas need to be between 1 and 5, got {self.nats_replicas}.")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"The metrics port needs to be between 0 and 65535, got {self.metrics_port}.")
        parse(self.checkpoint_url, self.data_dir / "checkpoints")  # a URL it cannot use stops the start

    @property
    def model_store(self) -> pathlib.Path:
        """Where base models and tokenizers live (runtime/storage/model_store.py)."""
        return self.model_store_dir or self.data_dir / "models"

    @property
    def tls_dir(self) -> pathlib.Path:
        """The CA and the certificates (runtime/security/tls.py): `<secrets_dir>/tls`."""
        return self.secrets_dir / "tls"

    @property
    def nats_servers(self) -> list[str]:
        return nats_servers(self.nats_url)

    @property
    def stream_prefix(self) -> str:
        return self.namespace.upper().replace("-", "_")

    def subject(self, suffix: str) -> str:
        return f"{self.namespace}.{suffix}"

    def stream(self, name: str) -> str:
        return f"{self.stream_prefix}_{name}"

    def desk_subject_root(self) -> str:
        # The default namespace publishes on the public `desk.telemetry.>`; others are isolated.
        from contracts.subjects import DESK_TELEMETRY

        return DESK_TELEMETRY if self.namespace == DEFAULT_NAMESPACE else f"{self.namespace}.{DESK_TELEMETRY}"

    def desk_live_root(self) -> str:
        """Where telemetry publishes running runs' progress for the desk (core NATS), by the same
        rule as `desk_subject_root`."""
        from contracts.subjects import DESK_LIVE

        return DESK_LIVE if self.namespace == DEFAULT_NAMESPACE else f"{self.namespace}.{DESK_LIVE}"


def nats_servers(url: str) -> list[str]:
    """The server pool of a NATS URL setting: one URL, or several separated by commas."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise ValueError(f"{ENV_NATS_URL} names no server: {url!r}.")
    return servers


def load(env: dict[str, str] | None = None) -> Settings:
    env = dict(os.environ) if env is None else env
    data_dir = pathlib.Path(env.get(ENV_DATA_DIR) or DEFAULT_DATA_DIR).absolute()
    return Settings(
        nats_url=env.get(ENV_NATS_URL) or DEFAULT_NATS_URL,
        redis_url=env.get(ENV_REDIS_URL) or DEFAULT_REDIS_URL,
        namespace=env.get(ENV_NAMESPACE) or DEFAULT_NAMESPACE,
        data_dir=data_dir,
        secrets_dir=pathlib.Path(env.get(ENV_SECRETS_DIR) or data_dir / "secrets").absolute(),
        model_store_dir=pathlib.Path(env[ENV_MODEL_STORE]).absolute() if env.get(ENV_MODEL_STORE) else None,
        confirmation_ttl_s=_float(env, ENV_CONFIRMATION_TTL_S, DEFAULT_CONFIRMATION_TTL_S),
        eligibility_ttl_s=_float(env, ENV_ELIGIBILITY_TTL_S, DEFAULT_ELIGIBILITY_TTL_S),
        idempotency_retention_s=_float(env, ENV_IDEMPOTENCY_RETENTION_S, DEFAULT_IDEMPOTENCY_RETENTION_S),
        request_timeout_s=_float(env, ENV_REQUEST_TIMEOUT_S, DEFAULT_REQUEST_TIMEOUT_S),
        small_model_gangs=env.get(ENV_PLAN_SMALL_MODEL_GANGS, "") == "1",
        rendezvous_host=env.get(ENV_RENDEZVOUS_HOST) or DEFAULT_RENDEZVOUS_HOST,
        nats_replicas=int(env.get(ENV_NATS_REPLICAS) or DEFAULT_NATS_REPLICAS),
        instance=env.get(ENV_INSTANCE, ""),
        redis_cluster=env.get(ENV_REDIS_CLUSTER, "") == "1",
        metrics_port=_port(env, ENV_METRICS_PORT, DEFAULT_METRICS_PORT),
        metrics_host=env.get(ENV_METRICS_HOST) or DEFAULT_METRICS_HOST,
        tls=env.get(ENV_TLS, "") == "1",
        checkpoint_url=env.get(ENV_CHECKPOINT_URL, ""),
        file_store_url=env.get(ENV_FILE_STORE_URL, ""),
        file_root=_absolute(env, ENV_FILE_ROOT),
        checkpoint_roots=tuple(
            _absolute_dir(ENV_CHECKPOINT_ROOTS, part)
            for part in env.get(ENV_CHECKPOINT_ROOTS, "").split(":")
            if part.strip()
        ),
        upload_ttl_s=_float(env, ENV_UPLOAD_TTL_S, DEFAULT_UPLOAD_TTL_S),
        s3_endpoint_url=env.get(ENV_S3_ENDPOINT_URL, ""),
    )


def _absolute_dir(name: str, value: str) -> pathlib.Path:
    path = pathlib.Path(value.strip())
    if not path.is_absolute():
        raise ValueError(f"{name} takes absolute paths, got {value!r}.")
    return pathlib.Path(os.path.normpath(path))


def _absolute(env: dict[str, str], name: str) -> pathlib.Path | None:
    value = env.get(name, "").strip()
    return _absolute_dir(name, value) if value else None


def entitlement_key(settings: Settings, env: dict[str, str] | None = None) -> bytes:
    """The HMAC key that signs eligibility statements: from the env, or a 0600 file.

    Without either, a key is generated once under the data dir (mode 0600) so that embedded
    infra works out of the box; production sets ITO_ENTITLEMENT_KEY_FILE. Never logged.
    """
    env = dict(os.environ) if env is None else env
    if env.get(ENV_ENTITLEMENT_KEY):
        return env[ENV_ENTITLEMENT_KEY].encode()
    path = pathlib.Path(env.get(ENV_ENTITLEMENT_KEY_FILE) or settings.data_dir / "entitlement.key")
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(32).hex())
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise ValueError(f"The entitlement key file {path} must have mode 0600, has {oct(mode)}.")
    return path.read_text().strip().encode()


@dataclass(frozen=True, slots=True)
class StoreUrl:
    scheme: str
    """"file" (a path on a filesystem this process mounts) or "s3"."""
    root: str
    """The absolute path, or `bucket/prefix` for s3 (no trailing slash)."""

    @property
    def remote(self) -> bool:
        return self.scheme == "s3"

    def __str__(self) -> str:
        return f"s3://{self.root}" if self.remote else self.root

    def join(self, *parts: str) -> "StoreUrl":
        for part in parts:
            if not part or "/" in part or part in (".", ".."):
                raise ValueError(f"A checkpoint path part must be one plain name, got {part!r}.")
        return StoreUrl(self.scheme, "/".join([self.root, *parts]))


def parse(url: str, local: pathlib.Path) -> StoreUrl:
    """The store `url` names; "" is `local` (the service's own checkpoint directory)."""
    if not url:
        return StoreUrl("file", str(local.absolute()))
    parsed = urlparse(url)
    if parsed.scheme == "" and os.path.isabs(url):
        return StoreUrl("file", os.path.normpath(url))
    if parsed.scheme == "file" and not parsed.netloc and os.path.isabs(parsed.path):
        return StoreUrl("file", os.path.normpath(parsed.path))
    if parsed.scheme == "s3" and parsed.netloc and not parsed.params and not parsed.query:
        prefix = parsed.path.strip("/")
        return StoreUrl("s3", f"{parsed.netloc}/{prefix}" if prefix else parsed.netloc)
    raise ValueError(
        f"{ENV_CHECKPOINT_URL} must be an absolute path, file:///path or s3://bucket/prefix, got {url!r}."
    )
