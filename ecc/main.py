"""`ecc` entry point: parse, dispatch, print, exit 0 only when the answer is ok.

Argument parsing is all that runs for `--help`: the verbs (and NATS, msgspec) load on demand, and
the MCP SDK only for `ecc mcp`. The parser is built one verb group at a time, in the order `--help`
lists the verbs; every help string comes from `ecc.verb_help`, which the MCP tools read too.
"""

import argparse
import os
import sys
import typing

from ecc.timeouts import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_TIMEOUT_S
from ecc.verb_help import OPTION_HELP, VERB_HELP

CONNECT_TIMEOUT_HELP = f"seconds to wait for the connection (default {DEFAULT_CONNECT_TIMEOUT_S:g})"
TIMEOUT_HELP = f"overall seconds for the call (default {DEFAULT_TIMEOUT_S:g})"
CONFIRM_ACTIONS = ["train", "cancel", "cleanup", "release_booking", "restart_from_checkpoint", "delete_file"]
RUN_STATES = [  # contracts.states.RunState's values, spelled here: `--help` imports no contract
    "accepted",
    "queued",
    "running",
    "interrupted",
    "awaiting_approval",
    "cancelling",
    "succeeded",
    "failed",
    "gate_failed",
    "cancelled",
    "budget_exhausted",
]

Verbs = argparse._SubParsersAction  # what `add_subparsers` returns; argparse names no public type

CONFIRM_FOR = {  # the `ecc ito confirm` that makes each verb's --confirmation-ref
    "train": "ecc ito confirm --action train --booking BOOKING --manifest PATH",
    "cancel": "ecc ito confirm --action cancel --run RUN",
    "cleanup": "ecc ito confirm --action cleanup --run RUN",
    "approve": "ecc ito confirm --action restart_from_checkpoint --run RUN",
    "files": "ecc ito confirm --action delete_file --file FILE",
}
MISSING_HELP = {
    "--account": "the account name that came with your API key",
    "--booking": "a booking id: `ecc ito find` lists yours",
    "--manifest": "the absolute path of your manifest (`ecc ito validate --manifest PATH` checks it)",
    "--idempotency-key": "a new unique string for this request (e.g. `$(uuidgen)`); reuse it only to "
    "retry the same request",
    "--action": "one of " + ", ".join(CONFIRM_ACTIONS),
    "--to": "the directory to write the export into",
    "--prompt": "the text to continue",
    "run": "a run id: `ecc ito runs` lists yours",
}
"""How to get each value argparse says is missing (its own message names the flag only)."""


class Parser(argparse.ArgumentParser):
    """argparse, whose "the following arguments are required" also says how to get each value."""

    def error(self, message: str) -> typing.NoReturn:
        missing = message.partition("the following arguments are required: ")[2]
        if missing:
            verb = self.prog.rsplit(" ", 1)[-1]
            lines = [message] + [f"  {name}: {_how_to_get(verb, name)}" for name in missing.split(", ")]
            message = "\n".join(lines)
        super().error(message)


def _how_to_get(verb: str, name: str) -> str:
    if name == "--confirmation-ref":
        command = CONFIRM_FOR.get(verb, "ecc ito confirm --action ACTION ...")
        return f"run `{command}` (a person's step); it prints the confirmation_ref"
    if name == "--release-confirmation-ref":
        return "run `ecc ito confirm --action release_booking --booking BOOKING`"
    return MISSING_HELP.get(name, "see --help")


def _common(p: argparse.ArgumentParser) -> None:
    """The options every verb takes, listed after the verb's own."""
    p.add_argument("--json", action="store_true", help="print the JSON envelope")
    p.add_argument(
        "--connect-timeout", type=float, default=DEFAULT_CONNECT_TIMEOUT_S, help=CONNECT_TIMEOUT_HELP
    )
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help=TIMEOUT_HELP)


def _session_verbs(verbs: Verbs) -> None:
    """Who I am and what I booked: login, logout, auth, find."""
    p = verbs.add_parser("login", help=VERB_HELP["login"])
    p.add_argument("--account", required=True)
    p.add_argument(
        "--ca",
        metavar="PATH",
        help="the CA file (ca.pem) that signed the server's TLS certificate; stored with the login, "
        "every later call verifies the server with it (default: ITO_NATS_CA)",
    )
    _common(p)
    _common(verbs.add_parser("logout", help=VERB_HELP["logout"]))
    _common(verbs.add_parser("auth", help=VERB_HELP["auth"]))
    _common(verbs.add_parser("find", help=VERB_HELP["find"]))


def _creation_verbs(verbs: Verbs) -> None:
    """From a reviewed manifest to a run: plan, confirm, train."""
    p = verbs.add_parser("plan", help=VERB_HELP["plan"])
    p.add_argument("--booking", required=True)
    p.add_argument("--manifest", required=True, help=OPTION_HELP["plan"]["manifest"])
    _common(p)
    p = verbs.add_parser("confirm", help=VERB_HELP["confirm"])
    p.add_argument("--action", required=True, choices=CONFIRM_ACTIONS)
    p.add_argument("--booking")
    p.add_argument("--run")
    p.add_argument("--file", help="delete_file: the file's id (`ecc ito files list`)")
    p.add_argument("--manifest")
    p.add_argument("--max-cost", type=float, help=OPTION_HELP["confirm"]["max_cost"])
    _common(p)
    p = verbs.add_parser("train", help=VERB_HELP["train"])
    p.add_argument("--booking", required=True)
    p.add_argument("--manifest", required=True)
    p.add_argument("--confirmation-ref", required=True)
    p.add_argument("--idempotency-key", required=True)
    _common(p)


def _view_verbs(verbs: Verbs) -> None:
    """Reads of your runs and of one run's progress: runs, status, metrics, checkpoints, evals."""
    p = verbs.add_parser("runs", help=VERB_HELP["runs"])
    p.add_argument("--state", choices=RUN_STATES, help=OPTION_HELP["runs"]["state"])
    p.add_argument("--booking", help=OPTION_HELP["runs"]["booking_id"])
    p.add_argument("--limit", type=int, help=OPTION_HELP["runs"]["limit"])
    p.add_argument("--cursor", help=OPTION_HELP["runs"]["cursor"])
    _common(p)
    p = verbs.add_parser("status", help=VERB_HELP["status"])
    p.add_argument("run", nargs="?")
    p.add_argument("--idempotency-key", help=OPTION_HELP["status"]["idempotency_key"])
    p.add_argument("--follow", action="store_true", help=OPTION_HELP["status"]["follow"])
    _common(p)
    p = verbs.add_parser("metrics", help=VERB_HELP["metrics"])
    p.add_argument("run")
    p.add_argument("--since", type=int, default=0, help=OPTION_HELP["metrics"]["since"])
    _common(p)
    p = verbs.add_parser("checkpoints", help=VERB_HELP["checkpoints"])
    p.add_argument("run")
    _common(p)
    p = verbs.add_parser("evals", help=VERB_HELP["evals"])
    p.add_argument("run")
    _common(p)


def _change_verbs(verbs: Verbs) -> None:
    """Mutations of one run, each with its own confirmation and idempotency key: cancel, cleanup, approve."""
    p = verbs.add_parser("cancel", help=VERB_HELP["cancel"])
    p.add_argument("run")
    p.add_argument("--confirmation-ref", required=True)
    p.add_argument("--idempotency-key", required=True)
    _common(p)
    p = verbs.add_parser("cleanup", help=VERB_HELP["cleanup"])
    p.add_argument("run")
    p.add_argument("--confirmation-ref", required=True)
    p.add_argument("--idempotency-key", required=True)
    p.add_argument("--release-booking", action="store_true", help=OPTION_HELP["cleanup"]["release_booking"])
    p.add_argument("--release-confirmation-ref", help=OPTION_HELP["cleanup"]["release_confirmation_ref"])
    _common(p)
    p = verbs.add_parser("approve", help=VERB_HELP["approve"])
    p.add_argument("run")
    p.add_argument("--confirmation-ref")
    p.add_argument("--idempotency-key", required=True)
    p.add_argument("--reject", action="store_true", help=OPTION_HELP["approve"]["reject"])
    _common(p)


def _record_verbs(verbs: Verbs) -> None:
    """A run's records: audit, logs."""
    p = verbs.add_parser("audit", help=VERB_HELP["audit"])
    p.add_argument("run")
    _common(p)
    p = verbs.add_parser("logs", help=VERB_HELP["logs"])
    p.add_argument("run")
    p.add_argument("--since", type=int, default=0, help=OPTION_HELP["logs"]["since"])
    p.add_argument("--follow", action="store_true")
    _common(p)


def _output_verbs(verbs: Verbs) -> None:
    """A trained model out (no confirmation: they spend nothing): export, download, sample."""
    p = verbs.add_parser("export", help=VERB_HELP["export"])
    p.add_argument("run")
    p.add_argument("--stage", help=OPTION_HELP["export"]["stage"])
    p.add_argument("--format", choices=["hf", "peft"], default="hf", help=OPTION_HELP["export"]["format"])
    _common(p)
    p = verbs.add_parser("download", help=VERB_HELP["download"])
    p.add_argument("run")
    p.add_argument("--export", help=OPTION_HELP["download"]["export"])
    p.add_argument("--to", required=True, help=OPTION_HELP["download"]["to"])
    _common(p)
    p = verbs.add_parser("sample", help=VERB_HELP["sample"])
    p.add_argument("run")
    p.add_argument("--prompt", required=True, help=OPTION_HELP["sample"]["prompt"])
    p.add_argument("--stage", help=OPTION_HELP["sample"]["stage"])
    p.add_argument("--max-new-tokens", type=int, default=64, help=OPTION_HELP["sample"]["max_new_tokens"])
    p.add_argument("--temperature", type=float, default=0.0, help=OPTION_HELP["sample"]["temperature"])
    p.add_argument("--seed", type=int, default=0, help=OPTION_HELP["sample"]["seed"])
    p.add_argument("--chat", action="store_true", help=OPTION_HELP["sample"]["chat"])
    _common(p)


def _model_verbs(verbs: Verbs) -> None:
    """What a manifest may name: models, files, connections, validate."""
    p = verbs.add_parser("models", help=VERB_HELP["models"])
    p.add_argument("action", nargs="?", choices=["list", "upload"], default="list")
    p.add_argument("directory", nargs="?", help="upload: " + OPTION_HELP["upload"]["path"])
    p.add_argument("--name", help="upload: the model's name in your manifests (default: the directory's)")
    _upload_options(p)
    p = verbs.add_parser("files", help=VERB_HELP["files"])
    p.add_argument("action", choices=["upload", "list", "show", "delete"])
    p.add_argument("target", nargs="?", help="upload: the file's path; show, delete: its id")
    p.add_argument("--name", help=OPTION_HELP["upload"]["name"])
    p.add_argument(
        "--purpose",
        choices=["train", "eval"],
        default="train",
        help="train or eval: what the file is for (`files list` shows it)",
    )
    p.add_argument(
        "--format", choices=["jsonl", "parquet"], help="jsonl or parquet (default: from the file's suffix)"
    )
    p.add_argument("--confirmation-ref", help="delete: a delete_file confirmation for the file")
    p.add_argument("--idempotency-key", help="delete: " + MISSING_HELP["--idempotency-key"])
    _upload_options(p)
    _common(verbs.add_parser("connections", help=VERB_HELP["connections"]))
    p = verbs.add_parser("validate", help=VERB_HELP["validate"])
    p.add_argument("--manifest", required=True, help="path of the manifest to check")
    _common(p)


def _upload_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--wait",
        type=float,
        default=600.0,
        help="upload: seconds to wait for the server's check of the upload (default 600)",
    )
    _common(p)


def parser() -> argparse.ArgumentParser:
    top = Parser(prog="ecc", description="Itô compute client.")
    groups = top.add_subparsers(dest="group", required=True)
    ito = groups.add_parser("ito", help="managed training on booked Itô GPU compute")
    verbs = ito.add_subparsers(dest="verb", required=True)
    for add_group in (
        _session_verbs,
        _model_verbs,
        _creation_verbs,
        _view_verbs,
        _change_verbs,
        _record_verbs,
        _output_verbs,
    ):
        add_group(verbs)
    _agents_door(groups)
    return top


def _agents_door(groups: Verbs) -> None:
    """`ecc mcp`: the verbs as MCP tools on stdio, for an agent; each call bounded like a verb's."""
    p = groups.add_parser(
        "mcp",
        help="serve the ito verbs to an agent as MCP tools on stdio "
        "(no confirm, no login: a person does those)",
        description="An MCP server on stdio: the `ecc ito` verbs as tools for an agent, with the "
        "login that `ecc ito login` stored. An agent can find, plan, train, watch, cancel and clean up; "
        "it never confirms (`ecc ito confirm` is a person's) and never sees a key. Register it with "
        'an MCP client as {"command": "ecc", "args": ["mcp"]}.',
    )
    p.add_argument(
        "--connect-timeout", type=float, default=DEFAULT_CONNECT_TIMEOUT_S, help=CONNECT_TIMEOUT_HELP
    )
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help=TIMEOUT_HELP)


PIPE_CLOSED = 1
"""The exit status when the reader of stdout went away (`ecc ito audit RUN | head -1`): not 0, since
not everything was shown (an ok answer is the only 0), and no traceback: the reader chose to stop."""


def _quiet_pipe_close() -> int:
    """Stdout's reader is gone: point stdout at /dev/null, so that the interpreter's last flush at
    exit has nowhere to fail (it would print `Exception ignored ... BrokenPipeError`), and stop."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return PIPE_CLOSED


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            status = _main(argv)
        finally:  # `--help` exits too: a reader that left is noticed here, not at the interpreter's exit
            sys.stdout.flush()
    except BrokenPipeError:
        return _quiet_pipe_close()
    return status


def _main(argv: list[str] | None) -> int:
    args = parser().parse_args(argv)
    if args.group == "mcp":  # the SDK loads only here (~0.7 s): never for `ecc ito` or `--help`
        from ecc import mcp_server

        return mcp_server.serve(args.connect_timeout, args.timeout)
    from ecc import verbs

    return verbs.dispatch(args)


if __name__ == "__main__":
    sys.exit(main())
