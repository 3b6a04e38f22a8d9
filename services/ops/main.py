"""`ito-training` entry point: serve, up, down, accounts, simulate-booking."""

import argparse
import asyncio
import dataclasses
import importlib
import json
import sys

from contracts.subjects import SERVICES
from services.runtime import settings as settings_mod
from services.runtime.settings import ENV_NATS_URL, ENV_REDIS_URL


def resolve_settings() -> settings_mod.Settings:
    """The environment, else the URLs `ito-training up` recorded, else the defaults."""
    import os

    s = settings_mod.load()
    from services.ops.stack import read_state

    state = read_state(s)
    if state:
        s = dataclasses.replace(
            s,
            nats_url=os.environ.get(ENV_NATS_URL) or state["nats_url"],
            redis_url=os.environ.get(ENV_REDIS_URL) or state["redis_url"],
        )
    return s


def manifest_schema() -> str:
    import msgspec

    from contracts.manifest import Manifest

    schema = msgspec.json.schema(Manifest)
    schema["title"] = "ito-training manifest"
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="ito-training", description="ito-training services and operations")
    cmds = top.add_subparsers(dest="cmd", required=True)
    p = cmds.add_parser("serve", help="run one service in the foreground")
    p.add_argument("service", choices=SERVICES)
    p = cmds.add_parser("up", help="infra (reused or embedded) and all services")
    p.add_argument("--detach", action="store_true", help="return once everything is ready")
    p.add_argument("--services", default=",".join(SERVICES),
                   help="comma-separated subset to start (default: all five)")
    p.add_argument("--json", action="store_true")
    p = cmds.add_parser("down", help="stop what `up` started")
    p.add_argument("--json", action="store_true")
    p = cmds.add_parser("accounts", help="create accounts and revoke their keys")
    acc = p.add_subparsers(dest="action", required=True)
    q = acc.add_parser("create", help="create an account key; printed once, stored only as a hash")
    q.add_argument("account")
    q.add_argument("--json", action="store_true")
    q = acc.add_parser("revoke", help="revoke every key of an account")
    q.add_argument("account")
    q.add_argument("--json", action="store_true")
    p = cmds.add_parser("desk", help="the desk's views")
    desk = p.add_subparsers(dest="view", required=True)
    q = desk.add_parser("telemetry", help="goodput, badput, interruptions and checkpoint bandwidth rollups")
    q.add_argument("--follow", action="store_true", help="keep printing updates")
    q.add_argument("--json", action="store_true")
    cmds.add_parser("manifest-schema", help="print the manifest's JSON Schema (generated from the contract)")
    p = cmds.add_parser("simulate-booking", help="publish an ito-compute booking event")
    p.add_argument("--account", required=True)
    p.add_argument("--booking", required=True)
    p.add_argument("--event", required=True, choices=["completed", "modified", "revoked", "expired", "released"])
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-model", default="H200")
    p.add_argument("--region", default="eu-central-1")
    p.add_argument("--fabric", default="infiniband", choices=["infiniband", "roce", "ethernet"])
    p.add_argument("--hours", type=float, default=24.0)
    p.add_argument("--version", type=int, help="upstream version (default: grows with time)")
    p.add_argument("--json", action="store_true")
    return top


def _print(args, data: dict, human: str) -> None:
    print(json.dumps(data) if getattr(args, "json", False) else human, flush=True)


async def _accounts(s: settings_mod.Settings, action: str, account: str) -> dict:
    from services.runtime import accounts, connections
    from services.runtime.keys import Keys

    r = connections.make_redis(s)
    try:
        if action == "create":
            api_key, key_id = await accounts.create(r, Keys(s), account)
            return {"account": account, "api_key": api_key, "key_id": key_id}
        return {"account": account, "revoked_keys": await accounts.revoke(r, Keys(s), account)}
    finally:
        await r.aclose()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.cmd == "serve":
        module = importlib.import_module(f"services.{args.service}.app")
        module.main()
        return 0
    if args.cmd == "manifest-schema":
        print(manifest_schema(), end="")
        return 0
    s = resolve_settings()
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if getattr(args, "json", False) else print
    try:
        if args.cmd in ("up", "down"):
            from services.ops import stack

            if args.cmd == "down":
                _print(args, stack.down(s, log), "")
                return 0
            chosen = tuple(n.strip() for n in args.services.split(",") if n.strip())
            unknown = set(chosen) - set(SERVICES)
            if unknown or not chosen:
                raise ValueError(f"--services takes names from {', '.join(SERVICES)}")
            state = stack.up(s, log, chosen)
            _print(args, {"nats_url": state["nats_url"], "redis_url": state["redis_url"],
                          "namespace": state["namespace"], "data_dir": str(s.data_dir)},
                   f"NATS {state['nats_url']}\nRedis {state['redis_url']}")
            if not args.detach:
                stack.wait_for_signal()
                stack.down(s, log)
            return 0
        if args.cmd == "desk":
            from services.ops import desk

            return desk.main(s, args.follow, args.json)
        if args.cmd == "accounts":
            data = asyncio.run(_accounts(s, args.action, args.account))
            human = (f"account {data['account']}: API key (shown once) {data['api_key']}" if args.action == "create"
                     else f"account {data['account']}: {data['revoked_keys']} key(s) revoked")
            _print(args, data, human)
            return 0
        if args.cmd == "simulate-booking":
            from services.ops import booking_sim

            ev = booking_sim.event(account=args.account, booking=args.booking, kind=args.event, nodes=args.nodes,
                                   gpus_per_node=args.gpus_per_node, gpu_model=args.gpu_model, region=args.region,
                                   fabric=args.fabric, hours=args.hours, version=args.version)
            data = asyncio.run(booking_sim.publish(s, ev))
            _print(args, data, f"published {data['kind']} for booking {data['booking_id']} (v{data['version']})")
            return 0
    except Exception as exc:  # operator tooling: one readable line, non-zero exit
        print(f"ito-training {args.cmd}: {exc}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
