"""`ito-training` entry point: serve, up, down, accounts, secrets, certs, models, simulate-booking."""

import argparse
import asyncio
import dataclasses
import importlib
import json
import pathlib
import sys
from collections.abc import Callable
from typing import Any

from contracts.connection import Connection
from contracts.subjects import SERVICES
from ecc import connection as ecc_connection
from runtime.configuration import settings as settings_mod
from runtime.configuration.settings import ENV_NATS_URL, ENV_REDIS_URL, ENV_SECRETS_DIR

Log = Callable[[str], None]


def resolve_settings() -> settings_mod.Settings:
    """The environment, else the URLs `ito-training up` recorded, else the defaults."""
    import os

    s = settings_mod.load()
    from devstack.stack import read_state

    state = read_state(s)
    if state:
        s = dataclasses.replace(
            s,
            nats_url=os.environ.get(ENV_NATS_URL) or state["nats_url"],
            redis_url=os.environ.get(ENV_REDIS_URL) or state["redis_url"],
            secrets_dir=pathlib.Path(
                os.environ.get(ENV_SECRETS_DIR) or state.get("secrets_dir") or s.secrets_dir
            ),
            nats_replicas=state.get("nats_replicas", s.nats_replicas),
            redis_cluster=state.get("redis_cluster", s.redis_cluster),
            tls=s.tls or bool(state.get("tls")),
        )
    return s


def manifest_schema() -> str:
    """The manifest's JSON Schema, generated from the contract (contracts/manifest_check.py: one source)."""
    from contracts import manifest_check

    return manifest_check.schema_text()


Commands = argparse._SubParsersAction  # what `add_subparsers` returns; argparse names no public type


def _stack_commands(cmds: Commands) -> None:
    """Run the services: serve, up, down."""
    p = cmds.add_parser("serve", help="run one service in the foreground")
    p.add_argument("service", choices=SERVICES)
    p = cmds.add_parser("up", help="infra (reused or embedded) and all services")
    p.add_argument("--detach", action="store_true", help="return once everything is ready")
    p.add_argument(
        "--cluster",
        action="store_true",
        help="a 3-node NATS cluster (streams R3) and two instances of every service",
    )
    p.add_argument(
        "--services", default=",".join(SERVICES), help="comma-separated subset to start (default: all five)"
    )
    p.add_argument("--desk", action="store_true", help="also the desk's web dashboard (`desk serve`)")
    p.add_argument(
        "--tls",
        action="store_true",
        help="NATS requires TLS, the desk and /metrics serve HTTPS, with <secrets dir>/tls "
        "(created when missing; same as ITO_TLS=1); clients verify with its ca.pem",
    )
    p.add_argument("--json", action="store_true")
    p = cmds.add_parser("down", help="stop what `up` started")
    p.add_argument("--json", action="store_true")


def _desk_commands(cmds: Commands) -> None:
    """The desk's tools: accounts, desk views, the manifest's schema, secrets."""
    p = cmds.add_parser("accounts", help="create accounts and revoke their keys")
    acc = p.add_subparsers(dest="action", required=True)
    q = acc.add_parser(
        "create", help="issue a credential (an NKey seed, printed once; only its public key is kept)"
    )
    q.add_argument("account")
    q.add_argument("--json", action="store_true")
    q = acc.add_parser("revoke", help="revoke every key of an account; the NATS server refuses them at once")
    q.add_argument("account")
    q.add_argument("--json", action="store_true")
    q = acc.add_parser(
        "quota",
        help="show or set an account's quotas (docs/quotas.md); a limit not given stays as it is",
    )
    q.add_argument("account")
    q.add_argument(
        "--rate", type=float, help="plan/confirm/train requests per second, sustained (default 20)"
    )
    q.add_argument("--burst", type=float, help="requests admitted at once after a quiet spell (default 600)")
    q.add_argument(
        "--confirmations",
        type=float,
        help="outstanding confirmations, neither used nor expired (default 256)",
    )
    q.add_argument("--runs", type=float, help="unfinished runs (default 256)")
    q.add_argument("--queued", type=float, help="runs waiting for a trainer (default 256)")
    q.add_argument(
        "--file-bytes",
        type=float,
        help="bytes of uploaded files and models, uploads under way included (default 256 GiB)",
    )
    q.add_argument("--files", type=float, help="uploaded data files (default 1000)")
    q.add_argument("--models", type=float, help="uploaded models (default 64)")
    q.add_argument("--json", action="store_true")
    p = cmds.add_parser("desk", help="the desk's views")
    desk = p.add_subparsers(dest="view", required=True)
    q = desk.add_parser("telemetry", help="goodput, badput, interruptions and checkpoint bandwidth rollups")
    q.add_argument("--follow", action="store_true", help="keep printing updates")
    q.add_argument("--json", action="store_true")
    q = desk.add_parser(
        "serve", help="the desk's web dashboard (runs, one run, the desk) behind an operator token"
    )
    q.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback)")
    q.add_argument("--port", type=int, default=8765, help="port (default 8765; 0: a free one)")
    q.add_argument("--json", action="store_true")
    cmds.add_parser("manifest-schema", help="print the manifest's JSON Schema (generated from the contract)")
    p = cmds.add_parser(
        "secrets",
        help="create the identities' credentials and the servers' auth config "
        "(for compose.yaml; `up` does this by itself)",
    )
    p.add_argument(
        "--rotate",
        action="append",
        default=[],
        metavar="IDENTITY",
        help="issue a new credential for this service identity (repeatable)",
    )
    p.add_argument("--json", action="store_true")


def _certs_command(cmds: Commands) -> None:
    """The deployment's CA and certificates: certs."""
    p = cmds.add_parser(
        "certs",
        help="create the CA and the server and client certificates (ECDSA P-256, keys 0600) under "
        "<secrets dir>/tls for TLS (`up --tls`, compose); existing ones are kept",
    )
    p.add_argument(
        "--rotate",
        action="store_true",
        help="issue new server and client certificates from the same CA (a running stack's NATS reloads them)",
    )
    p.add_argument(
        "--san",
        action="append",
        default=[],
        metavar="NAME",
        help="another DNS name or IP address the server certificate is valid for (repeatable; "
        "the name clients dial from other hosts); applied when the certificate is issued",
    )
    p.add_argument("--json", action="store_true")


def _model_commands(cmds: Commands) -> None:
    """The model store: models add, models list."""
    p = cmds.add_parser("models", help="the model store: base models and tokenizers tenants may name")
    verbs = p.add_subparsers(dest="action", required=True)
    q = verbs.add_parser(
        "add",
        help="check a Hugging Face directory (config.json, safetensors, tokenizer files) and store it "
        "by content digest; a directory with only a tokenizer.json becomes a tokenizer entry",
    )
    q.add_argument("path")
    q.add_argument("--name", help="the name manifests use (default: the directory's name)")
    q.add_argument(
        "--account",
        action="append",
        default=[],
        metavar="A",
        help="an account that may use it (repeatable; none: every account)",
    )
    q.add_argument("--json", action="store_true")
    q = verbs.add_parser("list", help="every stored model and its digest")
    q.add_argument("--json", action="store_true")


def _connection_commands(cmds: Commands) -> None:
    """A tenant's named connections to its own buckets: connections add, list, remove."""
    p = cmds.add_parser(
        "connections",
        help="named connections: how the backend reads a tenant's own bucket with a credential it "
        "holds (a manifest names s3://bucket/key and the connection, never the secret)",
    )
    verbs = p.add_subparsers(dest="action", required=True)
    q = verbs.add_parser("add", help="keep a connection for an account; the secret is read from a 0600 file")
    q.add_argument("name")
    q.add_argument("--account", required=True)
    q.add_argument(
        "--secret-file",
        required=True,
        type=pathlib.Path,
        help="a 0600 JSON file: access_key_id, secret_access_key (optionally session_token)",
    )
    q.add_argument("--endpoint-url", default="", help="an S3-compatible store's endpoint (default: AWS)")
    q.add_argument("--region", default="", help="the bucket's region (default us-east-1)")
    q.add_argument("--replace", action="store_true", help="replace a connection of that name")
    q.add_argument("--json", action="store_true")
    q = verbs.add_parser("list", help="an account's connections (never their secrets)")
    q.add_argument("--account", required=True)
    q.add_argument("--json", action="store_true")
    q = verbs.add_parser("remove", help="forget a connection")
    q.add_argument("name")
    q.add_argument("--account", required=True)
    q.add_argument("--json", action="store_true")


def _simulation_commands(cmds: Commands) -> None:
    """Stand-ins for ito-compute: simulate-booking."""
    p = cmds.add_parser("simulate-booking", help="publish an ito-compute booking event")
    p.add_argument("--account", required=True)
    p.add_argument("--booking", required=True)
    p.add_argument(
        "--event", required=True, choices=["completed", "modified", "revoked", "expired", "released"]
    )
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-model", default="H200")
    p.add_argument("--region", default="eu-central-1")
    p.add_argument("--fabric", default="infiniband", choices=["infiniband", "roce", "ethernet"])
    p.add_argument("--hours", type=float, default=24.0)
    p.add_argument("--version", type=int, help="upstream version (default: grows with time)")
    p.add_argument("--json", action="store_true")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="ito-training", description="ito-training services and operations")
    cmds = top.add_subparsers(dest="cmd", required=True)
    for add_group in (
        _stack_commands,
        _desk_commands,
        _certs_command,
        _model_commands,
        _connection_commands,
        _simulation_commands,
    ):
        add_group(cmds)
    return top


def _print(args: argparse.Namespace, data: dict[str, Any], human: str) -> None:
    print(json.dumps(data) if getattr(args, "json", False) else human, flush=True)


QUOTA_FLAGS = {
    "rate": "rate_per_s",
    "burst": "burst",
    "confirmations": "confirmations",
    "runs": "runs",
    "queued": "queued",
    "file_bytes": "file_bytes",
    "files": "files",
    "models": "models",
}
"""`accounts quota`'s flags and the limits they set (domain/quotas.py)."""


async def _accounts(
    s: settings_mod.Settings, action: str, account: str, changes: dict[str, float] | None = None
) -> dict[str, Any]:
    from runtime.configuration.keys import Keys
    from runtime.messaging import connections
    from runtime.security.identities import ACCOUNTS
    from runtime.tenancy import accounts

    r = connections.make_redis(s, ACCOUNTS)
    try:
        if action == "quota":
            import msgspec

            from runtime.tenancy.quota_stores import RedisQuotas

            if not accounts.valid_account(account):
                raise ValueError("account names are 1-64 ASCII letters, digits, '-' or '_'")
            limits = await RedisQuotas(r, Keys(s)).set_limits(account, changes or {})
            return {"account": account, "quotas": msgspec.to_builtins(limits)}
        if action == "create":
            api_key, key_id, public = await accounts.create(r, Keys(s), account)
            return {"account": account, "api_key": api_key, "key_id": key_id, "nkey": public}
        return {"account": account, "revoked_keys": await accounts.revoke(r, Keys(s), account)}
    finally:
        await r.aclose()


def _secrets(s: settings_mod.Settings, args: argparse.Namespace, log: Log) -> int:
    """Write the secrets dir for containers; with --rotate, replace identities' credentials first.
    A running stack (`up`) gets its config rewritten and reloaded too."""
    from devstack import nats_cluster, stack
    from runtime.security.identities import NATS_IDENTITIES, REDIS_IDENTITIES
    from runtime.security.secrets import Secrets

    sec = Secrets(s.secrets_dir)
    admin = (
        sec.password("admin") if sec.password_path("admin").exists() else None
    )  # to reload with, if rotated
    for identity in args.rotate:
        if identity not in NATS_IDENTITIES and identity not in REDIS_IDENTITIES:
            raise ValueError(f"unknown identity {identity!r}")
        if identity in NATS_IDENTITIES and sec.seed_path(identity).exists():
            sec.rotate_nats(identity)
        if identity in REDIS_IDENTITIES and sec.password_path(identity).exists():
            sec.rotate_redis(identity)
    state = stack.read_state(s)
    running = state is not None and stack.apply_tenants(s)
    if running and args.rotate:
        if admin is None:  # a running stack was started with an admin password: it is missing now
            raise RuntimeError(f"no admin password in {s.secrets_dir} to reload the running Redis with")
        stack.reload_redis_acl(s, admin)
    written = [] if running else nats_cluster.write_for_containers(s, [])
    _print(
        args,
        {
            "secrets_dir": str(s.secrets_dir),
            "rotated": args.rotate,
            "reloaded": running,
            "written": [str(p) for p in written],
        },
        f"secrets in {s.secrets_dir}" + (" (running stack reloaded)" if running else ""),
    )
    return 0


def _certs(s: settings_mod.Settings, args: argparse.Namespace, log: Log) -> int:
    """Create what is missing under `<secrets dir>/tls`; with --rotate, new leaves from the same
    CA, and a running stack's NATS reloads its config (nats-server reads the files again)."""
    from devstack import stack
    from runtime.security.tls import Certs, names_in

    certs = Certs(s.tls_dir)
    written = certs.rotate(args.san) if args.rotate else certs.ensure(args.san)
    state = stack.read_state(s)
    reloaded = bool(args.rotate and state and state.get("tls") and stack.apply_tenants(s))
    names = names_in(certs.server_cert.read_bytes())
    _print(
        args,
        {
            "tls_dir": str(certs.root),
            "ca": str(certs.ca),
            "written": [str(p) for p in written],
            "rotated": args.rotate,
            "reloaded": reloaded,
            "server_names": names,
        },
        f"certificates in {certs.root} (clients verify with {certs.ca})"
        + (f"; wrote {', '.join(p.name for p in written)}" if written else "; nothing new")
        + (" (running NATS reloaded; restart the desk to serve the new certificate)" if reloaded else ""),
    )
    return 0


def _up(s: settings_mod.Settings, args: argparse.Namespace, log: Log) -> int:
    from devstack import stack

    chosen = tuple(n.strip() for n in args.services.split(",") if n.strip())
    unknown = set(chosen) - set(SERVICES)
    if unknown or not chosen:
        raise ValueError(f"--services takes names from {', '.join(SERVICES)}")
    state = stack.up(s, log, chosen, cluster=args.cluster, desk=args.desk, tls=args.tls)
    connection_file = _write_connection(state)
    _print(
        args,
        {
            "nats_url": state["nats_url"],
            "redis_url": state["redis_url"],
            "namespace": state["namespace"],
            "data_dir": str(s.data_dir),
            "cluster": bool(state.get("cluster")),
            "services": sorted(state["services"]),
            "ready_s": state["ready_s"],
            **({"desk_url": state["desk"]["url"]} if "desk" in state else {}),
            "metrics": state["metrics"],
            "metrics_token_file": state["metrics_token_file"],
            "tls": bool(state.get("tls")),
            **({"ca": state["ca"]} if "ca" in state else {}),
            "connection_file": str(connection_file),
            "connection_export": ecc_connection.export_line(connection_file),
        },
        f"NATS {state['nats_url']}\nRedis {state['redis_url']}\n"
        f"Metrics (bearer token in {state['metrics_token_file']}): "
        + ", ".join(f"{name} {addr}" for name, addr in sorted(state["metrics"].items()))
        + f"\necc finds this stack through {connection_file}; in another shell: "
        + ecc_connection.export_line(connection_file),
    )
    if not args.detach:
        stack.wait_for_signal()
        stack.down(s, log)
    return 0


def _write_connection(state: dict[str, Any]) -> pathlib.Path:
    """The client's connection file (ecc/connection.py) for the stack just started: `ecc` then
    finds it with nothing set. The last `up` wins; `down` removes the file while it names its stack."""
    connection = Connection(url=state["nats_url"], namespace=state["namespace"], ca=state.get("ca"))
    return ecc_connection.save(connection)


def _down(s: settings_mod.Settings, args: argparse.Namespace, log: Log) -> int:
    from devstack import stack

    state = stack.read_state(s)
    _print(args, stack.down(s, log), "")
    if state and ecc_connection.remove_if_points_at(state["nats_url"]):
        log(f"removed {ecc_connection.path()}")
    return 0


def _desk(s: settings_mod.Settings, args: argparse.Namespace, log: Log) -> int:
    if args.view == "serve":
        from services.desk import app

        return app.main(s, args.host, args.port, args.json)
    from ops import desk_telemetry

    return desk_telemetry.main(s, args.follow, args.json)


def _accounts_command(s: settings_mod.Settings, args: argparse.Namespace, log: Log) -> int:
    from devstack import stack

    if args.action == "quota":
        return _quota_command(s, args)
    data = asyncio.run(_accounts(s, args.action, args.account))
    data["server_reloaded"] = stack.apply_tenants(s)
    human = (
        f"account {data['account']}: API key (shown once) {data['api_key']}"
        if args.action == "create"
        else f"account {data['account']}: {data['revoked_keys']} key(s) revoked"
    )
    _print(args, data, human)
    return 0


def _quota_command(s: settings_mod.Settings, args: argparse.Namespace) -> int:
    from runtime.messaging.codec import Refusal

    changes = {
        name: getattr(args, flag) for flag, name in QUOTA_FLAGS.items() if getattr(args, flag) is not None
    }
    try:
        data = asyncio.run(_accounts(s, "quota", args.account, changes))
    except (Refusal, ValueError) as exc:
        message = exc.message if isinstance(exc, Refusal) else str(exc)
        _print(args, {"account": args.account, "error": message}, f"error: {message}")
        return 2
    q = data["quotas"]
    human = (
        f"account {data['account']}: {q['rate_per_s']:g} requests/s (bursts of {q['burst']}), "
        f"{q['confirmations']} outstanding confirmations, {q['runs']} unfinished runs, "
        f"{q['queued']} waiting runs, {q['file_bytes']:,} bytes of files and models, {q['files']} files, "
        f"{q['models']} uploaded models"
    )
    _print(args, data, human)
    return 0


def _models(s: settings_mod.Settings, args: argparse.Namespace, log: Log) -> int:
    import msgspec

    from runtime.storage.model_store import ModelStore

    store = ModelStore(s.model_store)
    if args.action == "list":
        models = store.list()
        data: dict[str, Any] = {"store": str(store.root), "models": msgspec.to_builtins(models)}
        human = "\n".join(
            f"{m.name}: {m.digest} ({m.architecture}, {m.parameters:,} parameters"
            + (f", accounts {', '.join(m.accounts)})" if m.accounts else ", every account)")
            for m in models
        )
        _print(args, data, human or "(no models)")
        return 0
    path = pathlib.Path(args.path)
    if not (path / "config.json").exists() and (path / "tokenizer.json").is_file():
        tok = store.add_tokenizer(path)
        data = {"digest": tok.digest, "tokenizer": msgspec.to_builtins(tok)}
        _print(args, data, f"tokenizer {tok.digest} ({tok.vocab} tokens): name it as model.tokenizer")
        return 0
    entry = store.add(path, args.name, args.account)
    data = {"digest": entry.digest, "model": msgspec.to_builtins(entry)}
    _print(args, data, f"{entry.name}: {entry.digest} (put it in the manifest's model.revision)")
    return 0


def _connections(s: settings_mod.Settings, args: argparse.Namespace, log: Log) -> int:
    import msgspec

    from runtime.storage import data_connections
    from runtime.tenancy.accounts import valid_account

    if not valid_account(args.account):
        raise ValueError("account names are 1-64 ASCII letters, digits, '-' or '_'")
    if args.action == "list":
        listed = data_connections.listed(s.secrets_dir, args.account)
        human = "\n".join(f"{c.name}: {c.kind} {c.endpoint or '(AWS)'} {c.region}".rstrip() for c in listed)
        _print(args, {"connections": msgspec.to_builtins(listed)}, human or "(no connections)")
        return 0
    if args.action == "remove":
        removed = data_connections.remove(s.secrets_dir, args.account, args.name)
        _print(args, {"removed": removed}, f"connection {args.name}: {'removed' if removed else 'not there'}")
        return 0
    view = data_connections.add(
        s.secrets_dir,
        args.account,
        args.name,
        args.secret_file,
        endpoint_url=args.endpoint_url,
        region=args.region,
        replace=args.replace,
    )
    _print(
        args,
        {"connection": msgspec.to_builtins(view), "account": args.account},
        f"connection {view.name} for {args.account}: a manifest names it as `connection` beside an s3:// source",
    )
    return 0


def _simulate_booking(s: settings_mod.Settings, args: argparse.Namespace, log: Log) -> int:
    from devstack import booking_sim

    ev = booking_sim.event(
        account=args.account,
        booking=args.booking,
        kind=args.event,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        gpu_model=args.gpu_model,
        region=args.region,
        fabric=args.fabric,
        hours=args.hours,
        version=args.version,
    )
    data = asyncio.run(booking_sim.publish(s, ev))
    _print(args, data, f"published {data['kind']} for booking {data['booking_id']} (v{data['version']})")
    return 0


COMMANDS: dict[str, Callable[[settings_mod.Settings, argparse.Namespace, Log], int]] = {
    "up": _up,
    "down": _down,
    "secrets": _secrets,
    "certs": _certs,
    "desk": _desk,
    "accounts": _accounts_command,
    "models": _models,
    "connections": _connections,
    "simulate-booking": _simulate_booking,
}
"""The commands that act on the resolved settings: (settings, arguments, progress log) -> exit code."""


SERVICE_APPS = {"trainer": "services.trainer.app"}
"""A service's entry module where it is not `services.<name>.app` (the trainer's agent is a room of it)."""


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.cmd == "serve":
        module = importlib.import_module(SERVICE_APPS.get(args.service, f"services.{args.service}.app"))
        module.main()
        return 0
    if args.cmd == "manifest-schema":
        print(manifest_schema(), end="")
        return 0
    command = COMMANDS.get(args.cmd)
    if command is None:
        return 2
    s = resolve_settings()
    log: Log = (lambda m: print(m, file=sys.stderr, flush=True)) if getattr(args, "json", False) else print
    try:
        return command(s, args, log)
    except Exception as exc:  # operator tooling: one readable line, non-zero exit
        print(f"ito-training {args.cmd}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
