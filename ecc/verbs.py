"""The `ecc ito` verbs: read local inputs safely, make one bounded call, print the answer."""

import argparse
import asyncio
import getpass
import sys
from collections.abc import Callable

import msgspec

from contracts import subjects
from contracts.api import (
    Action,
    ApproveRequest,
    AuthRequest,
    CancelRequest,
    CleanupRequest,
    ConfirmRequest,
    FindRequest,
    LogsRequest,
    MetricsRequest,
    PlanRequest,
    RunItemsRequest,
    StatusRequest,
    TrainRequest,
)
from contracts.envelope import Envelope
from contracts.errors import ErrorCode
from ecc import credentials, render
from ecc.manifest_file import ManifestError, read_manifest
from ecc.transport import Client, SentButUnanswered, local_error, seed_of


def _logged_in() -> Envelope | None:
    if credentials.load() is None:
        return local_error(ErrorCode.unauthenticated, "not logged in; run `ecc ito login --account ACCOUNT`")
    return None


def _manifest(path: str) -> tuple[str, str] | Envelope:
    try:
        data, digest = read_manifest(path)
    except ManifestError as exc:
        return local_error(exc.code, exc.message)
    try:
        return data.decode("utf-8"), digest
    except UnicodeDecodeError:
        return local_error(ErrorCode.manifest_invalid, "the manifest is not UTF-8 text")


async def _read(args: argparse.Namespace, suffix: str, request: msgspec.Struct) -> Envelope:
    async with Client(args.connect_timeout, args.timeout) as client:
        try:
            return await client.call(suffix, request)
        except SentButUnanswered:
            return local_error(
                ErrorCode.timeout, "no answer in time; nothing was changed by this read", contacted=True
            )


async def _call_train(args: argparse.Namespace, request: TrainRequest) -> Envelope:
    """A train whose answer is lost is resolved by asking status by its idempotency key first."""
    async with Client(args.connect_timeout, args.timeout) as client:
        try:
            return await client.call(subjects.API_TRAIN, request)
        except SentButUnanswered:
            pass
    async with Client(args.connect_timeout, max(args.timeout / 2, 5.0)) as client:
        try:
            status = await client.call(
                subjects.API_STATUS, StatusRequest(idempotency_key=request.idempotency_key)
            )
        except SentButUnanswered:
            status = None
    if status is not None and status.ok:
        view = status.data
        return Envelope(
            ok=True,
            live_api_contacted=True,
            notice="the answer was lost in transit; this run was found by its idempotency key",
            data={
                "run_id": view["run_id"],
                "state": view["state"],
                "replay": True,
                "booking_id": view["booking_id"],
                "manifest_digest": view["manifest_digest"],
                "idempotency_key": request.idempotency_key,
            },
        )
    return local_error(
        ErrorCode.transport_ambiguous,
        "no answer in time and the run could not be found yet; ask "
        "`ecc ito status --idempotency-key KEY` before retrying",
        contacted=True,
    )


async def _mutate(args: argparse.Namespace, suffix: str, request: msgspec.Struct) -> Envelope:
    """A lost answer to a mutation is not retried blindly: its key makes a retry safe, so say so."""
    async with Client(args.connect_timeout, args.timeout) as client:
        try:
            return await client.call(suffix, request)
        except SentButUnanswered:
            return local_error(
                ErrorCode.transport_ambiguous,
                "no answer in time; the request may have taken effect. Retry with the same "
                "--idempotency-key: it is applied at most once",
                contacted=True,
            )


def _login(args: argparse.Namespace) -> Envelope:
    if sys.stdin.isatty():
        api_key = getpass.getpass("API key: ").strip()
    else:
        api_key = sys.stdin.readline().strip()
    if not api_key:
        return local_error(ErrorCode.unauthenticated, "no API key given on stdin")
    if seed_of(api_key) is None:
        return local_error(ErrorCode.unauthenticated, "that is not an ito-training API key")

    async def check() -> Envelope:
        async with Client(
            args.connect_timeout, args.timeout, credential=(args.account, api_key), fresh=True
        ) as c:
            try:
                return await c.call(subjects.API_AUTH, AuthRequest())
            except SentButUnanswered:
                return local_error(ErrorCode.timeout, "no answer in time; nothing was stored", contacted=True)

    env = asyncio.run(check())
    if env.ok:
        where = credentials.save(args.account, api_key)
        return Envelope(
            ok=True, live_api_contacted=True, notice=f"credential stored in {where}", data=env.data
        )
    return env


def _logout(args: argparse.Namespace) -> Envelope:
    removed = credentials.remove()
    return Envelope(ok=True, live_api_contacted=False, notice=None, data={"logged_out": removed})


def _auth(args: argparse.Namespace) -> Envelope:
    return asyncio.run(_read(args, subjects.API_AUTH, AuthRequest()))


def _find(args: argparse.Namespace) -> Envelope:
    return asyncio.run(_read(args, subjects.API_FIND, FindRequest()))


def _plan(args: argparse.Namespace) -> Envelope:
    m = _manifest(args.manifest)
    if isinstance(m, Envelope):
        return m
    text, digest = m
    req = PlanRequest(booking_id=args.booking, manifest_text=text, manifest_digest=digest)
    return asyncio.run(_read(args, subjects.API_PLAN, req))


def _train(args: argparse.Namespace) -> Envelope:
    """The manifest read here, then a call whose lost answer `_call_train` resolves."""
    m = _manifest(args.manifest)
    if isinstance(m, Envelope):
        return m
    text, digest = m
    req = TrainRequest(
        booking_id=args.booking,
        manifest_text=text,
        manifest_digest=digest,
        confirmation_ref=args.confirmation_ref,
        idempotency_key=args.idempotency_key,
    )
    return asyncio.run(_call_train(args, req))


def _confirm(args: argparse.Namespace) -> Envelope:
    text: str | None = None
    digest: str | None = None
    if args.manifest:
        m = _manifest(args.manifest)
        if isinstance(m, Envelope):
            return m
        text, digest = m
    req = ConfirmRequest(
        action=Action(args.action),
        booking_id=args.booking,
        run_id=args.run,
        manifest_text=text,
        manifest_digest=digest,
        max_cost_usd=args.max_cost,
    )
    return asyncio.run(_read(args, subjects.API_CONFIRM, req))


def _status(args: argparse.Namespace) -> Envelope:
    if not args.run and not args.idempotency_key:
        return local_error(ErrorCode.request_invalid, "give a run id or --idempotency-key")
    req = StatusRequest(run_id=args.run, idempotency_key=args.idempotency_key)
    if args.follow:
        return asyncio.run(render.follow(args, req))
    return asyncio.run(_read(args, subjects.API_STATUS, req))


def _metrics(args: argparse.Namespace) -> Envelope:
    req = MetricsRequest(run_id=args.run, since=args.since)
    return asyncio.run(_read(args, subjects.API_METRICS, req))


def _checkpoints(args: argparse.Namespace) -> Envelope:
    return asyncio.run(_read(args, subjects.API_CHECKPOINTS, RunItemsRequest(run_id=args.run)))


def _evals(args: argparse.Namespace) -> Envelope:
    return asyncio.run(_read(args, subjects.API_EVALS, RunItemsRequest(run_id=args.run)))


def _cancel(args: argparse.Namespace) -> Envelope:
    req = CancelRequest(
        run_id=args.run, confirmation_ref=args.confirmation_ref, idempotency_key=args.idempotency_key
    )
    return asyncio.run(_mutate(args, subjects.API_CANCEL, req))


def _cleanup(args: argparse.Namespace) -> Envelope:
    req = CleanupRequest(
        run_id=args.run,
        confirmation_ref=args.confirmation_ref,
        idempotency_key=args.idempotency_key,
        release_booking=args.release_booking,
        release_confirmation_ref=args.release_confirmation_ref,
    )
    return asyncio.run(_mutate(args, subjects.API_CLEANUP, req))


def _approve(args: argparse.Namespace) -> Envelope:
    req = ApproveRequest(
        run_id=args.run,
        confirmation_ref=args.confirmation_ref,
        idempotency_key=args.idempotency_key,
        reject=args.reject,
    )
    return asyncio.run(_mutate(args, subjects.API_APPROVE, req))


def _audit(args: argparse.Namespace) -> Envelope:
    from contracts.audit import AuditRequest

    return asyncio.run(_read(args, subjects.API_AUDIT, AuditRequest(run_id=args.run)))


def _logs(args: argparse.Namespace) -> Envelope:
    req = LogsRequest(run_id=args.run, since=args.since)
    if args.follow:
        return asyncio.run(render.follow_logs(args, req))
    return asyncio.run(_read(args, subjects.API_LOGS, req))


Verb = Callable[[argparse.Namespace], Envelope]

WITHOUT_LOGIN: dict[str, Verb] = {"login": _login, "logout": _logout}
"""Verbs that run without a stored credential."""
LOGGED_IN: dict[str, Verb] = {
    "auth": _auth,
    "find": _find,
    "plan": _plan,
    "train": _train,
    "confirm": _confirm,
    "status": _status,
    "metrics": _metrics,
    "checkpoints": _checkpoints,
    "evals": _evals,
    "cancel": _cancel,
    "cleanup": _cleanup,
    "approve": _approve,
    "audit": _audit,
    "logs": _logs,
}
"""Verbs that need a stored credential: without one they answer `unauthenticated` and call nothing."""


def run_verb(args: argparse.Namespace) -> Envelope:
    if args.verb in WITHOUT_LOGIN:
        return WITHOUT_LOGIN[args.verb](args)
    missing = _logged_in()
    if missing is not None:
        return missing
    verb = LOGGED_IN.get(args.verb)
    if verb is None:
        return local_error(ErrorCode.request_invalid, f"unknown verb {args.verb}")
    return verb(args)


def dispatch(args: argparse.Namespace) -> int:
    env = run_verb(args)
    render.show(args, env)
    return 0 if env.ok else 1
