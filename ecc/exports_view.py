"""How a trained model going out, and the base models coming in, read for a person (ecc/render.py
dispatches here by type): a sample's completion (and that the trainer's deadline cut it short),
an export and its files, an export downloaded and verified on this machine
(`Downloaded`, the answer ecc/download.py makes), the base models the account may name. Pure
functions of the decoded answers.
"""

import msgspec

from contracts.api import ModelList
from contracts.exports import ExportFile, ExportView, SampleResult


class Downloaded(msgspec.Struct, frozen=True, kw_only=True):
    """`ecc ito download`'s answer (ecc/download.py): where the export is now, and that its
    digest, recomputed from the files on disk, is the export's."""

    run_id: str
    export_id: str
    directory: str
    digest: str
    files: list[ExportFile]
    bytes: int
    fetched_bytes: int  # sent over the wire by this call (the rest was on disk already)


def sample(result: SampleResult) -> str:
    if not result.truncated:
        return result.text
    return (
        f"{result.text}\n(truncated: the trainer's deadline stopped the sample after "
        f"{result.tokens} tokens; ask for fewer with --max-new-tokens)"
    )


def export(view: ExportView) -> str:
    line = f"export {view.export_id or view.stage + '-' + view.format}: {view.state}"
    if view.step:
        line += f" (stage {view.stage}, step {view.step})"
    if view.message:
        line += f"\n  {view.message}"
    if view.state == "ready":
        line += f"\n  digest {view.digest}, {len(view.files)} files, {view.bytes} bytes"
        line += "".join(f"\n  {f.path} ({f.bytes} bytes)" for f in view.files)
        line += f"\n  fetch it with `ecc ito download {view.run_id} --export {view.export_id} --to DIR`"
    return line


def downloaded(done: Downloaded) -> str:
    rows = [f"{f.path} ({f.bytes} bytes)" for f in done.files]
    rows.append(
        f"export {done.export_id} in {done.directory}: {len(done.files)} files, {done.bytes} bytes "
        f"({done.fetched_bytes} fetched), digest {done.digest} verified"
    )
    return "\n".join(rows)


def models(listed: ModelList) -> str:
    rows = [
        f"{m.name}: {m.digest} ({m.architecture}, {m.parameters:,} parameters, vocab {m.vocab_size:,}, "
        f"context {m.max_seq_len:,}"
        + ("" if m.tokenizer else ", no tokenizer")
        + (", chat template" if m.chat_template else "")
        + ")"
        for m in listed.models
    ]
    return "\n".join(rows) or "(no models for this account)"
