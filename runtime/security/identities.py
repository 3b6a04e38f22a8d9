"""Who may do what on the bus and in the store: every identity's NATS permissions and Redis ACL.

This is the one place the authorization policy lives. It is data plus pure functions that write
the nats-server config and the Redis ACL file from it (tested as tables). Allow-lists only: an
identity may publish, subscribe and touch keys named here and nothing else; the `default` Redis
user is off; there is no unauthenticated NATS user.

Inboxes: a service's replies arrive under `_INBOX_svc_<identity>`, a tenant's under
`_INBOX_t_<account>`, so no identity can subscribe to another's answers. Tenants publish only
`<ns>.v1.api.<verb>.<account>`: the account in the subject is authenticated by the server, and the
scheduler takes the caller's account from there (and checks the reply inbox against it).
"""

import hashlib
import json
from dataclasses import dataclass

from contracts import subjects
from runtime.configuration.settings import Settings

SERVICE_IDENTITIES = subjects.SERVICES
"""Each service connects to NATS as itself."""
COMPUTE = "compute"  # the upstream ito-compute publisher of booking events
DESK = "desk"  # desk subscribers and the desk app: read-only telemetry and the scheduler's desk reads
OPERATOR = "operator"  # declares streams, reloads config; never used by a service
NATS_IDENTITIES = (*SERVICE_IDENTITIES, COMPUTE, DESK, OPERATOR)

ACCOUNTS = "accounts"  # `ito-training accounts`: the account registry only
ADMIN = "admin"  # operator's break-glass and the test suite's eyes; no service uses it
REPLICATION = "replication"  # a Redis Cluster replica, as it syncs from its primary; nothing else
REDIS_SERVICES = ("entitlement", "confirmation", "ledger", "scheduler", "telemetry")
"""The trainer keeps no state in Redis and gets no Redis credential at all."""
REDIS_IDENTITIES = (*REDIS_SERVICES, ACCOUNTS, ADMIN, REPLICATION)

TRAINER_EVENT_KINDS = (
    "state",
    "log",
    "metrics",
    "checkpoint",
    "stage",
    "eval",
    "provenance",
    "proposal",
    "parallelism",
)
SCHEDULER_EVENT_KINDS = ("created", "interruption")


def service_inbox(identity: str) -> str:
    return f"_INBOX_svc_{identity}"


def tenant_inbox(account: str) -> str:
    return f"_INBOX_t_{account}"


def tenant_subject(settings: Settings, verb_suffix: str, account: str) -> str:
    """`<ns>.v1.api.<verb>.<account>`: what a tenant publishes a request on."""
    return settings.subject(f"{verb_suffix}.{account}")


@dataclass(frozen=True, slots=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    responses: bool = False
    """May answer requests it received (one reply to each reply subject), and nothing more."""


def _durable(stream: str, durable: str) -> tuple[str, ...]:
    """Create/bind one named pull consumer on one stream, fetch from it and ack its messages."""
    return (
        f"$JS.API.CONSUMER.CREATE.{stream}.{durable}",
        f"$JS.API.CONSUMER.CREATE.{stream}.{durable}.>",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{durable}",
        f"$JS.API.CONSUMER.INFO.{stream}.{durable}",
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}",
        f"$JS.ACK.{stream}.{durable}.>",
    )


def _reader(stream: str) -> tuple[str, ...]:
    """Replay one stream through short-lived consumers of its own (never purge or delete messages)."""
    return (
        f"$JS.API.CONSUMER.CREATE.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.INFO.{stream}.>",
        f"$JS.API.CONSUMER.DELETE.{stream}.>",
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.>",
        f"$JS.ACK.{stream}.>",
        f"$JS.FC.{stream}.>",
    )


def nats_permissions(identity: str, s: Settings) -> Permissions:
    """What `identity` may publish and subscribe to on the bus.

    A table with one case per identity, kept whole on purpose (it is longer than our functions
    usually are): the policy is reviewed by reading every identity's rights side by side, and
    tests/security/test_policy.py checks it as a table."""
    ns, st = s.subject, s.stream
    health = ns(f"{subjects.HEALTH}.{identity}")
    inbox = service_inbox(identity) + ".>"
    match identity:
        case "scheduler":
            return Permissions(
                publish=(
                    ns("v1.entitlement.>"),
                    ns("v1.confirmation.>"),
                    ns("v1.ledger.>"),
                    ns(subjects.TRAINER_CLEANUP),
                    # exports, downloads and samples: orders to any trainer (signed)
                    ns(subjects.TRAINER_EXPORT),
                    ns(subjects.TRAINER_DOWNLOAD),
                    ns(subjects.TRAINER_SAMPLE),
                    ns(f"{subjects.CONTROL_CANCEL}.*"),
                    ns(f"{subjects.WORK_TRAIN}.>"),
                    ns(f"{subjects.AUDIT}.>"),
                    ns(subjects.BOOKING_RELEASE_REQUESTS),
                    *(ns(f"{subjects.RUN_EVENTS}.*.{k}") for k in SCHEDULER_EVENT_KINDS),
                    *_durable(st(subjects.STREAM_RUNS), f"{s.namespace}-{subjects.CONSUMER_SCHEDULER_RUNS}"),
                    *_reader(st(subjects.STREAM_AUDIT)),
                ),
                subscribe=(
                    ns("v1.api.*.*"),
                    ns(subjects.RUN_LEASE),
                    ns(subjects.DESK_RUNS),
                    ns(subjects.DESK_RUN),
                    health,
                    inbox,
                ),
                responses=True,
            )
        case "entitlement":
            return Permissions(
                publish=_durable(
                    st(subjects.STREAM_BOOKINGS), f"{s.namespace}-{subjects.CONSUMER_ENTITLEMENT}"
                ),
                subscribe=(ns("v1.entitlement.>"), health, inbox),
                responses=True,
            )
        case "confirmation" | "ledger":
            return Permissions(publish=(), subscribe=(ns(f"v1.{identity}.>"), health, inbox), responses=True)
        case "trainer":
            return Permissions(
                publish=(
                    ns(subjects.RUN_LEASE),
                    *(ns(f"{subjects.RUN_EVENTS}.*.{k}") for k in TRAINER_EVENT_KINDS),
                    *_durable(st(subjects.STREAM_WORK), f"{s.namespace}-{subjects.CONSUMER_TRAINER}"),
                ),
                subscribe=(
                    ns(f"{subjects.CONTROL_CANCEL}.*"),
                    ns(subjects.TRAINER_CLEANUP),
                    # exports, downloads and samples: the scheduler's orders
                    ns(subjects.TRAINER_EXPORT),
                    ns(subjects.TRAINER_DOWNLOAD),
                    ns(subjects.TRAINER_SAMPLE),
                    health,
                    inbox,
                ),
                responses=True,
            )
        case "telemetry":
            return Permissions(
                publish=(
                    s.desk_subject_root() + ".>",
                    s.desk_live_root() + ".*",
                    *_durable(st(subjects.STREAM_RUNS), f"{s.namespace}-{subjects.CONSUMER_TELEMETRY}"),
                ),
                subscribe=(health, inbox),
                responses=True,
            )
        case "compute":
            return Permissions(
                publish=(ns(f"{subjects.BOOKING_EVENTS}.>"),),
                subscribe=(ns(subjects.BOOKING_RELEASE_REQUESTS), inbox),
            )
        case "desk":
            # Read-only: replay DESK, hear live progress, and ask the scheduler's two desk reads.
            return Permissions(
                publish=(*_reader(st(subjects.STREAM_DESK)), ns(subjects.DESK_RUNS), ns(subjects.DESK_RUN)),
                subscribe=(s.desk_subject_root() + ".>", s.desk_live_root() + ".*", inbox),
            )
        case "operator":
            return Permissions(publish=(">",), subscribe=(">",), responses=True)
    raise ValueError(f"unknown identity {identity!r}")


def tenant_permissions(account: str, s: Settings) -> Permissions:
    return Permissions(publish=(s.subject(f"v1.api.*.{account}"),), subscribe=(tenant_inbox(account) + ".>",))


def _user(nkey: str, p: Permissions) -> dict:
    # An empty allow-list would mean "no restriction" to nats-server: say "deny everything" instead.
    publish = {"allow": list(p.publish)} if p.publish else {"deny": [">"]}
    perms: dict = {"publish": publish, "subscribe": {"allow": list(p.subscribe)}}
    if p.responses:
        perms["allow_responses"] = {"max": 1, "expires": "1m"}
    return {"nkey": nkey, "permissions": perms}


MAX_PAYLOAD_BYTES = 4 * 1024 * 1024  # a train request carries a manifest of up to 1 MiB; the default is 1 MB


def nats_config(
    s: Settings,
    *,
    port: int,
    store_dir: str,
    services: dict[str, str],
    tenants: list[tuple[str, str]],
    host: str = "127.0.0.1",
    tls_dir: str | None = None,
) -> str:
    """The nats-server config (JSON is valid NATS config syntax). `services`: identity -> public
    nkey; `tenants`: (account, public nkey) of every active tenant credential. `tls_dir`: where
    the server certificate lives (runtime/security/tls.py): then every client connection must
    speak TLS (the server refuses plain ones); clients still authenticate with their nkey."""
    users = [_user(nkey, nats_permissions(identity, s)) for identity, nkey in sorted(services.items())]
    users += [_user(nkey, tenant_permissions(account, s)) for account, nkey in sorted(tenants)]
    config = {
        "listen": f"{host}:{port}",
        "max_payload": MAX_PAYLOAD_BYTES,
        "jetstream": {"store_dir": store_dir},
        "authorization": {"users": users, "timeout": 2},  # no no_auth_user: no credential, no connection
    }
    if tls_dir is not None:
        config["tls"] = nats_tls(tls_dir)
    return json.dumps(config, indent=1) + "\n"


def nats_tls(tls_dir: str, verify: bool = False) -> dict:
    """A nats-server `tls {}` block with the certificates under `tls_dir`; `verify`: the peer must
    present a certificate of the same CA too (the cluster's routes)."""
    block: dict = {
        "cert_file": f"{tls_dir}/server.pem",
        "key_file": f"{tls_dir}/server.key",
        "ca_file": f"{tls_dir}/ca.pem",
        "timeout": 2,  # seconds for the handshake (nats-server's default 0.5 is short on a busy host)
    }
    if verify:
        block["verify"] = True
    return block


# --- Redis ---

_REDIS_CONNECT = "+ping +hello +auth"  # redis-py ignores a refused CLIENT SETINFO
_REDIS_CLUSTER_CLIENT = "+cluster|slots +command"
"""What redis-py's cluster client sends before any command: the slot map, and the command table it
finds a command's keys in (without them it fails with a misleading "Cluster mode is not enabled").
Both only describe the server; a single server answers CLUSTER SLOTS with an error."""


def redis_rules(identity: str, s: Settings) -> tuple[tuple[str, ...], str]:
    """(key patterns, commands) of one Redis user. Lua scripts run with the caller's rights, so the
    commands a script calls are listed too.

    A table with one case per identity, kept whole on purpose, as `nats_permissions` is: every
    user's keys and commands read side by side."""
    ns = s.namespace
    acct = f"{ns}:{{*}}"
    scripts = "+evalsha +eval +script|load"
    match identity:
        case "scheduler":
            return (
                (
                    f"{acct}:run:*",
                    f"{acct}:runs",  # one account's runs by creation time: the tenant's `runs` list
                    f"{ns}:run-owner:*",
                    f"{ns}:leased:*",
                    f"{ns}:leased",  # the lease index before it was split: read and released only
                    f"{ns}:apikeys:*",
                    f"{ns}:run-index:*",  # every run by creation time, split in shards: the desk's list
                    f"{acct}:quota",  # the operator's limits (read; the bucket script reads them too)
                    f"{acct}:bucket",  # the request-rate bucket, shared by every scheduler instance
                    f"{acct}:open-runs",  # the unfinished runs: the `runs` and `queued` quotas
                    # a tenant's uploads and files (services/scheduler/file_records.py)
                    f"{acct}:upload:*",
                    f"{acct}:upload-spec:*",
                    f"{acct}:uploads",
                    f"{acct}:stored",
                    f"{acct}:file:*",
                    f"{acct}:files",
                    f"{acct}:file-digest:*",
                    f"{ns}:upload-expiry:*",
                ),
                "+get +set +mget +del +hget +hmget +hset +hsetnx +hdel +hgetall +hincrby +zadd +zrem +zrange +zcard "
                "+zrangebyscore +zrevrange +zrevrangebyscore "
                "+rpush +ltrim +llen +lrange +sadd +srem +smembers +scard +pexpire +time "
                f"+multi +exec +discard {scripts}",
            )
        case "ledger":
            return (
                (f"{acct}:idem:*", f"{acct}:conf:*", f"{acct}:pending", f"{ns}:accounts:*", f"{ns}:accounts"),
                f"+get +set +hmget +hset +sadd +srem +sismember +smembers +time {scripts}",
            )
        case "confirmation":
            return (
                (
                    f"{acct}:conf:*",
                    f"{ns}:conf-owner:*",
                    f"{acct}:conf-open",  # the outstanding confirmations: the `confirmations` quota
                    f"{acct}:quota",  # the operator's limits (read)
                ),
                "+get +set +hget +hset +hgetall +expire +pexpire +time +multi +exec +discard "
                f"+zadd +zrange +zrem +zremrangebyscore +zscore {scripts}",
            )
        case "entitlement":
            return (
                (
                    f"{acct}:booking:*",
                    f"{acct}:bookings",
                    f"{ns}:booking-owner:*",
                    f"{ns}:booking-parked:*",
                    f"{ns}:booking-stats:*",
                    f"{ns}:booking-stats",
                ),
                f"+get +set +del +hget +hset +hincrby +sadd +smembers +rpush +lrange {scripts}",
            )
        case "telemetry":
            return (
                (f"{ns}:telemetry:*", f"{ns}:desk:*"),
                "+hget +hset +hvals +hgetall +expire +multi +exec +discard",
            )
        case "accounts":
            return (
                (f"{ns}:apikeys:*", f"{ns}:accounts:*", f"{ns}:accounts", f"{acct}:quota"),
                "+hget +hset +hgetall +sadd +smembers",
            )
        case "admin":
            return (("*",), "+@all")
        case "replication":
            return ((), "+psync +replconf")  # no key, no command that reads or writes one
    raise ValueError(f"unknown Redis identity {identity!r}")


def redis_acl(s: Settings, passwords: dict[str, str]) -> str:
    """The ACL file: `default` off, one user per identity, passwords only as SHA-256."""
    lines = ["user default off resetkeys resetchannels -@all"]
    for identity in sorted(passwords):
        patterns, commands = redis_rules(identity, s)
        digest = hashlib.sha256(passwords[identity].encode()).hexdigest()
        rights = " ".join(
            [*(f"~{p}" for p in patterns), "resetchannels -@all", _REDIS_CONNECT]
            + ([] if identity == REPLICATION else [_REDIS_CLUSTER_CLIENT])
            + [commands]
        )
        lines.append(f"user {identity} on #{digest} resetkeys {rights}")
    return "\n".join(lines) + "\n"
