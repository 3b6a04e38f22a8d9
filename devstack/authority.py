"""Embedded infra with authentication: write the servers' auth config from the policy
(runtime/security/identities.py) and the account registry, start the servers, apply changes.

Files, all under the secrets dir (0700), each 0600: `nats.conf` (public nkeys and permissions),
`redis.acl` (users, SHA-256 of passwords, key patterns, commands), and the credentials themselves
(runtime/security/secrets.py). A tenant added or revoked rewrites `nats.conf` and reloads the
running nats-server (SIGHUP): a revoked credential's open connections are dropped at once.
"""

import asyncio
import fcntl
import os
import pathlib
import signal
import time
from contextlib import contextmanager

from devstack import infra
from runtime.configuration.settings import Settings, nats_servers
from runtime.messaging import streams
from runtime.security.identities import (
    ACCOUNTS,
    NATS_IDENTITIES,
    OPERATOR,
    REDIS_IDENTITIES,
    nats_config,
    redis_acl,
)
from runtime.security.secrets import Secrets
from runtime.security.tls import Certs

RELOAD_TIMEOUT_S = 10.0
NATS_CONFIG = "nats.conf"
REDIS_ACL = "redis.acl"


def secrets(s: Settings) -> Secrets:
    sec = Secrets(s.secrets_dir)
    sec.ensure(NATS_IDENTITIES, REDIS_IDENTITIES)
    return sec


def write_private(path: pathlib.Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)
    os.replace(tmp, path)


@contextmanager
def config_lock(s: Settings):
    """One writer of the config at a time (two `accounts create` at once must not lose a tenant)."""
    with open(s.secrets_dir / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_redis_acl(s: Settings) -> pathlib.Path:
    sec = secrets(s)
    path = s.secrets_dir / REDIS_ACL
    write_private(path, redis_acl(s, {i: sec.password(i) for i in REDIS_IDENTITIES}))
    return path


def write_nats_config(
    s: Settings,
    port: int,
    tenants: list[tuple[str, str]],
    host: str = "127.0.0.1",
    store_dir: str | None = None,
    tls_dir: str | None = None,
) -> pathlib.Path:
    """`nats.conf` (0600); with TLS on (`tls_dir`, or `s.tls`: the certificates under the secrets
    dir) the server refuses plain connections."""
    sec = secrets(s)
    if tls_dir is None and s.tls:
        tls_dir = str(ensure_certs(s).root)
    if store_dir is None:
        store = s.data_dir / "nats"
        store.mkdir(parents=True, exist_ok=True, mode=0o700)
        store_dir = str(store)
    path = s.secrets_dir / NATS_CONFIG
    write_private(
        path,
        nats_config(
            s,
            port=port,
            store_dir=store_dir,
            host=host,
            services={i: sec.public_nkey(i) for i in NATS_IDENTITIES},
            tenants=tenants,
            tls_dir=tls_dir,
        ),
    )
    return path


def ensure_certs(s: Settings) -> Certs:
    """The CA and certificates under the secrets dir, created when missing (kept otherwise)."""
    certs = Certs(s.tls_dir)
    certs.ensure()
    return certs


async def active_tenants(s: Settings, redis_url: str) -> list[tuple[str, str]]:
    import dataclasses

    from runtime.configuration.keys import Keys
    from runtime.messaging import connections
    from runtime.tenancy import accounts

    r = connections.make_redis(dataclasses.replace(s, redis_url=redis_url), ACCOUNTS)
    try:
        return await accounts.active_tenants(r, Keys(s))
    finally:
        await r.aclose()


async def declare_streams(s: Settings, nats_url: str) -> None:
    nc = await connect(s, OPERATOR, nats_url)
    try:
        await streams.declare(nc.jetstream(timeout=s.request_timeout_s), s)
    finally:
        await nc.close()


async def connect(s: Settings, identity: str, url: str | None = None, **options):
    """A plain nats-py connection as one identity (operator tooling, tests, benchmarks)."""
    import nats

    from runtime.messaging.connections import nats_auth

    servers = nats_servers(url or s.nats_url)  # a cluster's URLs: the client's server pool
    nc = await nats.connect(servers, connect_timeout=2, **nats_auth(s, identity), **options)
    if not nc._server_info.get("auth_required"):
        await nc.close()
        raise RuntimeError(
            f"the NATS server at {url or s.nats_url} does not require authentication; refusing it"
        )
    if s.tls and not nc._server_info.get("tls_required"):  # a plain server where TLS is expected
        await nc.close()
        raise RuntimeError(f"the NATS server at {url or s.nats_url} does not speak TLS; refusing it")
    return nc


def start_redis(s: Settings, log_dir: pathlib.Path, port: int | None = None) -> infra.Started:
    aclfile = write_redis_acl(s)
    return infra.on_free_port(
        lambda p: infra.start_redis(s.data_dir / "redis", aclfile, p, log_dir / "redis.log"), port
    )


def start_nats(s: Settings, log_dir: pathlib.Path, redis_url: str, port: int | None = None) -> infra.Started:
    tenants = asyncio.run(active_tenants(s, redis_url))

    def start(p: int) -> infra.Started:
        with config_lock(s):
            config = write_nats_config(s, p, tenants)
        return infra.start_nats(config, p, log_dir / "nats.log")

    return infra.on_free_port(start, port)


def start_infra(s: Settings, log_dir: pathlib.Path) -> tuple[infra.Started, infra.Started]:
    """Redis (ACLs, AOF always) and NATS (nkeys, permissions, JetStream) of our own, streams declared."""
    log_dir.mkdir(parents=True, exist_ok=True)
    redis = start_redis(s, log_dir)
    try:
        nats = start_nats(s, log_dir, redis.url)
        asyncio.run(declare_streams(s, nats.url))
    except Exception:
        if redis.pid is not None:  # None: not ours to stop
            infra.stop_pid(redis.pid)
        raise
    return nats, redis


def reloads_logged(log_path: pathlib.Path) -> int:
    try:
        return log_path.read_text(errors="replace").count("Reloaded server configuration")
    except OSError:
        return 0


def apply_tenants(
    s: Settings, nats_pid: int, port: int, tenants: list[tuple[str, str]], log_path: pathlib.Path
) -> None:
    """Rewrite the config with these tenants and reload the running server; returns once the
    server says it reloaded (bounded)."""
    with config_lock(s):
        before = reloads_logged(log_path)
        write_nats_config(s, port, tenants)
        os.kill(nats_pid, signal.SIGHUP)
        deadline = time.monotonic() + RELOAD_TIMEOUT_S
        while reloads_logged(log_path) <= before:
            if time.monotonic() > deadline:
                raise RuntimeError("nats-server did not confirm the config reload; see its log")
            time.sleep(0.05)
