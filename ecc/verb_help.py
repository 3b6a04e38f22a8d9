"""What each verb and option does, in words: the one table `ecc ito --help` and the MCP tools read.

`ecc.main` builds the parser's help from here and `ecc.tools` builds each tool's description and
its arguments' descriptions from the same strings, so a person and an agent read the same words.
This module imports nothing: `--help` stays free of NATS, msgspec and the MCP SDK.
"""

VERB_HELP: dict[str, str] = {
    "login": "store an API key (read from stdin or a prompt, never an argument)",
    "logout": "forget the stored API key",
    "auth": "who am I",
    "find": "list your bookings and what they allow",
    "plan": "plan a run on a booking; creates nothing",
    "confirm": "confirm an action; returns an opaque confirmation_ref",
    "train": "create a training run (needs a confirmation and an idempotency key)",
    "runs": "list your runs, newest first (a page at a time; --cursor with the last page's next)",
    "status": "a run's state, by run id or by idempotency key",
    "metrics": "a run's per-step metrics",
    "checkpoints": "a run's committed checkpoints (step, size, loop stall)",
    "evals": "each stage's eval battery: every metric, its threshold, pass/fail",
    "cancel": "stop a run (needs its own cancel confirmation and idempotency key)",
    "cleanup": "remove a finished run's artifacts; the booking is untouched unless --release-booking",
    "approve": "decide a paused run's restart proposal (loss spike): approve with a "
    "restart_from_checkpoint confirmation, or --reject",
    "audit": "a run's gate decisions (who, which gate, pass/fail and code)",
    "logs": "a run's log lines",
    # A trained model out: none of these spends a booking or changes a run, so none needs a confirmation.
    "export": "export a run's committed checkpoint as a Hugging Face directory (or a LoRA stage's PEFT "
    "adapter); ask again until ready. No confirmation: it spends nothing and changes no run",
    "download": "fetch a ready export into a directory on this machine (resumable, digest-checked). "
    "No confirmation: it only reads",
    "sample": "generate text from a run's committed checkpoint. No confirmation: it only reads",
    "models": "the base models your account may fine-tune (put the digest in model.revision); "
    "`models upload DIR --name NAME` adds your own Hugging Face checkpoint",
    # A tenant's own inputs (contracts/files.py): nothing on the server is named by its path.
    "upload": "upload a JSONL/Parquet file or a Hugging Face checkpoint: resumable, checked whole before "
    "it is kept",
    "upload_part": "one part of an upload's file (the `files upload` client sends them)",
    "upload_commit": "check an upload and keep it; asked again, its state (the `files upload` client calls it)",
    "files": "your files (a manifest names one as upload:<file_id>) and uploads under way",
    "file": "one of your files: its digest, rows and kinds of row",
    "file_delete": "delete one of your files (confirm --action delete_file first)",
    "connections": "your named connections (an s3:// data ref names one)",
    "validate": "check a manifest against its JSON Schema: every problem at once, with its path, line, "
    "column and the allowed values (sends nothing, needs no login)",
}
"""One line per `ecc ito` verb (its `--help` entry; the first line of its MCP tool's description)."""

OPTION_HELP: dict[str, dict[str, str]] = {
    "plan": {"manifest": "absolute path of the reviewed manifest"},
    "confirm": {
        "max_cost": "the most you confirm the run may spend, in USD; the run is stopped before it spends more (default: what the manifest and booking allow: budget_cap_usd, or the booking plus max_incremental_cost_usd if lower)"
    },
    "runs": {
        "state": "only runs in this state",
        "booking_id": "only runs on this booking",
        "limit": "the most runs in one page (1-100, default 20)",
        "cursor": "the next of the page before, to read the runs after it (default: from the newest)",
    },
    "status": {
        "follow": "follow until the run ends",
        "idempotency_key": "the idempotency key the run's train was sent with",
    },
    "metrics": {"since": "index of the first point"},
    "cleanup": {
        "release_booking": "also ask ito-compute to release the booking (needs --release-confirmation-ref)",
        "release_confirmation_ref": "a `release_booking` confirmation for the run's booking",
    },
    "approve": {"reject": "keep the run paused; nothing restarts"},
    "upload": {
        "path": "the file, or the checkpoint's directory, on this machine",
        "kind": "data (a file) or model (a checkpoint directory)",
        "name": "default: the file's or directory's",
    },
    "file_delete": {"file_id": "the file's id (from `files list`)"},
    "logs": {"since": "index of the first line"},
    "export": {
        "stage": "the stage to export (default: the last stage with a committed checkpoint)",
        "format": "hf: a Hugging Face directory; peft: a LoRA stage's adapter alone",
    },
    "download": {
        "export": "the export id, <stage>-<format> (default: the last stage's hf export)",
        "export_id": "the export id, <stage>-<format> (default: the last stage's hf export)",
        "to": "the directory to write the files into (made 0700 when new; files 0600)",
    },
    "sample": {
        "prompt": "the text to continue",
        "stage": "the stage whose checkpoint to sample (default: the last with a committed checkpoint)",
        "max_new_tokens": "the most tokens to generate (at most 512)",
        "temperature": "0 is greedy; higher samples more freely (seeded: the same request, the same text)",
        "seed": "the sampling seed",
        "chat": "render the prompt as one user message with the tokenizer's chat template",
    },
}
"""Per verb, the help of the options that have one, by field name (`--release-booking` is
`release_booking`)."""

FIELD_HELP: dict[str, str] = {
    "booking_id": "the booking's id (from find)",
    "run_id": "the run's id (from train's answer)",
    "manifest": OPTION_HELP["plan"]["manifest"],
    "confirmation_ref": "the opaque reference a person created with `ecc ito confirm`",
    "idempotency_key": "your key for this request: reuse it on a retry, never for another request",
    "limit": "the most items in one answer",
}
"""What an argument means wherever a verb has no more specific help for it (the MCP tools' argument
descriptions; the CLI spells these as its flags)."""


def option_help(verb: str, field: str) -> str | None:
    """The words for one verb's option: its own, else the field's general meaning."""
    return OPTION_HELP.get(verb, {}).get(field) or FIELD_HELP.get(field)


def for_tools(words: str) -> str:
    """Help written for the CLI as a tool's argument names read: `--release-booking` -> `release_booking`."""
    import re  # here, not at the top: `--help` needs no regular expression

    return re.sub(r"--([a-z][a-z-]*)", lambda m: m[1].replace("-", "_"), words)
