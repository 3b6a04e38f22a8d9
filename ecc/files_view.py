"""How a tenant's own inputs read for a person (ecc/render.py dispatches here by type): an upload's
state, a kept file and the data ref that names it, the account's files, its connections. Pure
functions of the decoded answers; the lines scripts parse start with the ids.
"""

import json

from contracts.files import (
    ConnectionList,
    FileDeleted,
    FileList,
    FileView,
    UploadPartAck,
    UploadSession,
    UploadView,
)


def size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


def data_ref(view: FileView) -> str:
    """The manifest data ref that names the file (a name to fill in, its digest pinned)."""
    ref = {"name": view.name.rsplit(".", 1)[0] or "data", "source": view.source, "digest": view.sha256}
    return json.dumps(ref)


def file_view(view: FileView) -> str:
    kinds = ", ".join(view.kinds) or "no kind a stage reads"
    return "\n".join(
        [
            f"file {view.file_id}: {view.name} ({view.format.value}, {size(view.bytes)}, {view.rows:,} rows: {kinds})",
            f"  sha256: {view.sha256}",
            f"  purpose: {view.purpose.value}; kept {view.created_at.isoformat(timespec='seconds')}",
            f"  in a manifest: {data_ref(view)}",
        ]
    )


def upload_view(view: UploadView) -> str:
    if view.file is not None:
        return file_view(view.file)
    if view.model is not None:
        m = view.model
        return (
            f"model {m.name}: {m.digest} ({m.architecture}, {m.parameters:,} parameters)\n"
            f'  in a manifest: "model": {{"base": "{m.name}", "revision": "{m.digest}"}}'
        )
    lines = [f"upload {view.upload_id}: {view.state}" + (f": {view.message}" if view.message else "")]
    lines += [f"  - {p}" for p in view.problems]
    if view.more_problems:
        lines.append(f"  - ... and {view.more_problems} more")
    return "\n".join(lines)


def session(s: UploadSession) -> str:
    lines = [f"upload {s.upload_id}: {s.state} ({s.kind.value} {s.name})"]
    lines += [f"  {f.path}: {size(f.received)} of {size(f.bytes)}" for f in s.files]
    return "\n".join(lines)


def files(listed: FileList) -> str:
    lines = [
        f"{f.file_id}  {f.name}  {f.format.value}  {size(f.bytes)}  {f.rows:,} rows  {', '.join(f.kinds)}"
        for f in listed.files
    ]
    for s in listed.uploads:
        got = sum(f.received for f in s.files)
        want = sum(f.bytes for f in s.files)
        lines.append(
            f"{s.upload_id}  {s.name}  {s.state}: {size(got)} of {size(want)} (run the upload again to resume)"
        )
    return "\n".join(lines) or "(no files)"


def deleted(done: FileDeleted) -> str:
    return f"file {done.file_id}: deleted ({size(done.bytes)} freed)" + (" (replay)" if done.replay else "")


def part(ack: UploadPartAck) -> str:
    return f"{ack.path}: {ack.received:,} bytes received"


def connections(listed: ConnectionList) -> str:
    rows = [
        f"{c.name}  {c.kind}"
        + (f"  {c.endpoint}" if c.endpoint else "")
        + (f"  {c.region}" if c.region else "")
        for c in listed.connections
    ]
    return "\n".join(rows) or "(no connections: ask your operator to add one)"
