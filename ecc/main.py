"""`ecc` entry point: parse, dispatch, print, exit 0 only when the answer is ok.

Argument parsing is all that runs for `--help`: the verbs (and NATS, msgspec) load on demand.
The parser is built one verb group at a time, in the order `--help` lists the verbs.
"""

import argparse
import sys

from ecc.timeouts import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_TIMEOUT_S

CONNECT_TIMEOUT_HELP = f"seconds to wait for the connection (default {DEFAULT_CONNECT_TIMEOUT_S:g})"
TIMEOUT_HELP = f"overall seconds for the call (default {DEFAULT_TIMEOUT_S:g})"
CONFIRM_ACTIONS = ["train", "cancel", "cleanup", "release_booking", "restart_from_checkpoint"]

Verbs = argparse._SubParsersAction  # what `add_subparsers` returns; argparse names no public type


def _common(p: argparse.ArgumentParser) -> None:
    """The options every verb takes, listed after the verb's own."""
    p.add_argument("--json", action="store_true", help="print the JSON envelope")
    p.add_argument(
        "--connect-timeout", type=float, default=DEFAULT_CONNECT_TIMEOUT_S, help=CONNECT_TIMEOUT_HELP
    )
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help=TIMEOUT_HELP)


def _session_verbs(verbs: Verbs) -> None:
    """Who I am and what I booked: login, logout, auth, find."""
    p = verbs.add_parser("login", help="store an API key (read from stdin or a prompt, never an argument)")
    p.add_argument("--account", required=True)
    _common(p)
    _common(verbs.add_parser("logout", help="forget the stored API key"))
    _common(verbs.add_parser("auth", help="who am I"))
    _common(verbs.add_parser("find", help="list your bookings and what they allow"))


def _creation_verbs(verbs: Verbs) -> None:
    """From a reviewed manifest to a run: plan, confirm, train."""
    p = verbs.add_parser("plan", help="plan a run on a booking; creates nothing")
    p.add_argument("--booking", required=True)
    p.add_argument("--manifest", required=True, help="absolute path of the reviewed manifest")
    _common(p)
    p = verbs.add_parser("confirm", help="confirm an action; returns an opaque confirmation_ref")
    p.add_argument("--action", required=True, choices=CONFIRM_ACTIONS)
    p.add_argument("--booking")
    p.add_argument("--run")
    p.add_argument("--manifest")
    p.add_argument(
        "--max-cost", type=float, help="the most you confirm to spend, in USD (default: the plan's estimate)"
    )
    _common(p)
    p = verbs.add_parser("train", help="create a training run (needs a confirmation and an idempotency key)")
    p.add_argument("--booking", required=True)
    p.add_argument("--manifest", required=True)
    p.add_argument("--confirmation-ref", required=True)
    p.add_argument("--idempotency-key", required=True)
    _common(p)


def _view_verbs(verbs: Verbs) -> None:
    """Reads of one run's progress: status, metrics, checkpoints, evals."""
    p = verbs.add_parser("status", help="a run's state, by run id or by idempotency key")
    p.add_argument("run", nargs="?")
    p.add_argument("--idempotency-key")
    p.add_argument("--follow", action="store_true", help="follow until the run ends")
    _common(p)
    p = verbs.add_parser("metrics", help="a run's per-step metrics")
    p.add_argument("run")
    p.add_argument("--since", type=int, default=0, help="index of the first point")
    _common(p)
    p = verbs.add_parser("checkpoints", help="a run's committed checkpoints (step, size, loop stall)")
    p.add_argument("run")
    _common(p)
    p = verbs.add_parser("evals", help="each stage's eval battery: every metric, its threshold, pass/fail")
    p.add_argument("run")
    _common(p)


def _change_verbs(verbs: Verbs) -> None:
    """Mutations of one run, each with its own confirmation and idempotency key: cancel, cleanup, approve."""
    p = verbs.add_parser("cancel", help="stop a run (needs its own cancel confirmation and idempotency key)")
    p.add_argument("run")
    p.add_argument("--confirmation-ref", required=True)
    p.add_argument("--idempotency-key", required=True)
    _common(p)
    p = verbs.add_parser(
        "cleanup", help="remove a finished run's artifacts; the booking is untouched unless --release-booking"
    )
    p.add_argument("run")
    p.add_argument("--confirmation-ref", required=True)
    p.add_argument("--idempotency-key", required=True)
    p.add_argument(
        "--release-booking",
        action="store_true",
        help="also ask ito-compute to release the booking (needs --release-confirmation-ref)",
    )
    p.add_argument(
        "--release-confirmation-ref", help="a `release_booking` confirmation for the run's booking"
    )
    _common(p)
    p = verbs.add_parser(
        "approve",
        help="decide a paused run's restart proposal (loss spike): approve with a "
        "restart_from_checkpoint confirmation, or --reject",
    )
    p.add_argument("run")
    p.add_argument("--confirmation-ref")
    p.add_argument("--idempotency-key", required=True)
    p.add_argument("--reject", action="store_true", help="keep the run paused; nothing restarts")
    _common(p)


def _record_verbs(verbs: Verbs) -> None:
    """A run's records: audit, logs."""
    p = verbs.add_parser("audit", help="a run's gate decisions (who, which gate, pass/fail and code)")
    p.add_argument("run")
    _common(p)
    p = verbs.add_parser("logs", help="a run's log lines")
    p.add_argument("run")
    p.add_argument("--since", type=int, default=0, help="index of the first line")
    p.add_argument("--follow", action="store_true")
    _common(p)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="ecc", description="Itô compute client.")
    groups = top.add_subparsers(dest="group", required=True)
    ito = groups.add_parser("ito", help="managed training on booked Itô GPU compute")
    verbs = ito.add_subparsers(dest="verb", required=True)
    for add_group in (_session_verbs, _creation_verbs, _view_verbs, _change_verbs, _record_verbs):
        add_group(verbs)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from ecc import verbs

    return verbs.dispatch(args)


if __name__ == "__main__":
    sys.exit(main())
