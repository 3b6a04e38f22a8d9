"""The manifest's inputs as they are now: the base model in the model store, the tokenizer, and the
tenant's own data (uploads, `file:` refs under the account's root, `s3://` objects through its
connections), gathered here (I/O) and judged by the pure checks in domain/plan_inputs.py,
each time a manifest is planned, confirmed or trained: unlike the manifest's bytes, the store, the
uploads and the files can change between two requests, so a manifest whose digest passed before
proves nothing about them.

A data ref that is not the tenant's is refused from its text alone, before anything is looked up
(domain/data_refs.py): a `file:` path outside the account's root gets the same answer
whether or not anything is there, an upload or a connection of another account the same answer as
one that does not exist. What passes is resolved into `DataInput`s (locator, digest, format) that
the work item carries and the trainer reads, never the manifest's own text.

Cheap by construction: the store is read through small files (names.json, MODEL.json,
config.json; the weights are never re-hashed here, the trainer does that with `ModelStore.verify`
before it loads), an upload's check is its record (made when it was committed), and a `file:` or
`s3://` ref's check is remembered while its bytes are the same (services/scheduler/data_facts.py).
"""

import asyncio
import json
from dataclasses import dataclass

from contracts.errors import ErrorCode
from contracts.files import DataInput, FileView, InputKind
from contracts.manifest import DataRef, DataRole, Manifest
from contracts.models import BaseModel
from domain import data_refs, plan_inputs
from domain.curriculum import Curriculum, curriculum_of
from domain.data_refs import SourceKind
from domain.data_schemas import file_format
from domain.model_shapes import UnsupportedConfig, shape_from_hf_config
from runtime.messaging.codec import Refusal
from runtime.storage.model_store import MAX_CONFIG_BYTES, ModelStore
from services.scheduler.data_facts import DataFacts, Facts
from services.scheduler.file_records import FileRecords


def _refuse(refusal: plan_inputs.Refusal | None) -> None:
    if refusal is not None:
        raise Refusal(*refusal)


@dataclass(frozen=True, slots=True)
class Runnable:
    """What the inputs gate found: the run's stages, its base model, its data as resolved."""

    curriculum: Curriculum
    base: BaseModel | None
    inputs: list[DataInput]


def _from_report(facts: Facts) -> plan_inputs.FileFacts:
    if facts.report is None:
        return plan_inputs.FileFacts(digest=None, unreadable=facts.unreadable or "the file cannot be read")
    r = facts.report
    return plan_inputs.FileFacts(
        digest=r.sha256,
        kinds=tuple(r.kinds),
        columns=tuple(r.columns),
        problems=tuple(r.problems),
        more_problems=r.more_problems,
        format=r.format,
    )


def _from_upload(view: FileView) -> plan_inputs.FileFacts:
    return plan_inputs.FileFacts(
        digest=view.sha256, kinds=tuple(view.kinds), columns=tuple(view.columns), format=view.format
    )


class ManifestInputs:
    """Resolves and checks a manifest's base model, tokenizer and data (see the module doc)."""

    def __init__(
        self,
        store: ModelStore | None,
        files: FileRecords | None = None,
        facts: DataFacts | None = None,
        file_root: str | None = None,
    ) -> None:
        self.store = store
        self.files = files  # None: no upload resolves (handler tests without the upload port)
        self.facts = facts
        self.file_root = file_root  # where `file:` refs may point: `<root>/<account>/...`; None: nowhere

    async def runnable(self, manifest: Manifest, account: str) -> Runnable:
        """The curriculum, the resolved base model and data, or a Refusal: the model's codes first,
        then the manifest's own (`manifest_invalid`), the tokenizer, the data in manifest order."""
        return await self._runnable(manifest, account)

    async def _runnable(self, manifest: Manifest, account: str) -> Runnable:
        spec = manifest.model
        base = None
        if spec.base is not None and spec.size is None:
            facts = await asyncio.to_thread(self.model_facts, spec.base, account)
            _refuse(plan_inputs.model_refusal(spec, facts))
            base = facts.entry
        try:
            plan = curriculum_of(manifest, base)
        except ValueError as exc:
            raise Refusal(ErrorCode.manifest_invalid, f"the manifest cannot run: {exc}") from None
        assert plan.shape is not None, "curriculum_of sets the starting shape"
        vocab = await asyncio.to_thread(self._tokenizer_vocab, spec.tokenizer)
        _refuse(plan_inputs.tokenizer_refusal(spec, plan.shape, base, vocab))
        readers: dict[str, list[str]] = {}
        for stage in plan.stages:
            for name in stage.data:
                readers.setdefault(name, []).append(stage.name)
        inputs = []
        for i, ref in enumerate(manifest.data):
            if not data_refs.is_tenant(ref.source):
                continue
            stages = ["eval"] if ref.role is DataRole.eval else readers.get(ref.name, [])
            inputs.append(await self._data(i, ref, stages, account))
        return Runnable(plan, base, inputs)

    async def _data(self, i: int, ref: DataRef, stages: list[str], account: str) -> DataInput:
        """One tenant data ref resolved, or its refusal (see the module doc)."""
        match data_refs.kind_of(ref.source):
            case SourceKind.upload:
                view = await self._upload(i, ref, account)
                facts = _from_upload(view)
                _refuse(plan_inputs.data_refusal(i, ref, stages, facts))
                return DataInput(
                    name=ref.name,
                    kind=InputKind.upload,
                    locator=view.file_id,
                    digest=view.sha256,
                    format=view.format,
                    bytes=view.bytes,
                )
            case SourceKind.file:
                relative = data_refs.file_below_root(ref.source, self.file_root, account)
                if relative is None:
                    raise Refusal(ErrorCode.data_policy_violation, self._not_yours(i))
                fmt = file_format(ref)
                assert self.facts is not None, "file: refs are resolved where a file root is configured"
                found = await self.facts.file(account, relative, fmt)
                if found.report is None and (found.unreadable or "").startswith("no readable file"):
                    raise Refusal(ErrorCode.data_digest_mismatch, f"data[{i}].source: {found.unreadable}")
                facts = _from_report(found)
                _refuse(plan_inputs.data_refusal(i, ref, stages, facts))
                assert found.report is not None, "a ref without a report was refused above"
                return DataInput(
                    name=ref.name,
                    kind=InputKind.file,
                    locator=relative,
                    digest=found.report.sha256,
                    format=fmt,
                    bytes=found.report.bytes,
                )
            case SourceKind.s3:
                return await self._s3(i, ref, stages, account)
        raise AssertionError(f"not a tenant source: {ref.source!r}")

    def _not_yours(self, i: int) -> str:
        if self.file_root is None:
            return (
                f"data[{i}].source: file: refs are off on this backend; upload the file "
                "(`ecc ito files upload PATH`) and name it as upload:<file id>"
            )
        return (
            f"data[{i}].source: a file: ref names a file under this account's file root, which the "
            "operator configures; upload other files (`ecc ito files upload PATH`)"
        )

    async def _upload(self, i: int, ref: DataRef, account: str) -> FileView:
        file_id, digest = data_refs.upload_target(ref.source)
        view = None
        if self.files is not None and file_id is not None:
            view = await self.files.file(account, file_id)
        elif self.files is not None and digest is not None:
            view = await self.files.file_by_digest(account, digest)
        if view is None:
            shown = ref.source.removeprefix("upload:")[:80]
            raise Refusal(
                ErrorCode.data_not_found,
                f"data[{i}].source: no upload {shown!r} for this account (`ecc ito files list` lists yours)",
            )
        return view

    async def _s3(self, i: int, ref: DataRef, stages: list[str], account: str) -> DataInput:
        target = data_refs.s3_target(ref.source)
        if target is None:
            raise Refusal(
                ErrorCode.data_policy_violation,
                f"data[{i}].source: not a plain s3://bucket/key (no query, no '..')",
            )
        if ref.connection is None:
            raise Refusal(
                ErrorCode.data_policy_violation,
                f"data[{i}].connection: an s3:// ref names the connection to read it through "
                "(`ecc ito connections` lists yours); credentials never go in a manifest",
            )
        if ref.digest is None:
            raise Refusal(
                ErrorCode.data_digest_mismatch,
                f"data[{i}].digest: an s3:// object needs the sha256 of its bytes, so the run trains on "
                "what was reviewed (objects change)",
            )
        assert self.facts is not None, "the API has its data facts"
        fmt = file_format(ref)
        found = await self.facts.s3(account, ref.connection, target[0], target[1], fmt)
        if found.report is None and (found.unreadable or "").startswith("no connection"):
            raise Refusal(
                ErrorCode.data_not_found,
                f"data[{i}].connection: no connection {ref.connection!r} for this account "
                "(`ecc ito connections` lists yours)",
            )
        _refuse(plan_inputs.data_refusal(i, ref, stages, _from_report(found)))
        assert found.report is not None, "a ref without a report was refused above"
        return DataInput(
            name=ref.name,
            kind=InputKind.s3,
            locator=f"{target[0]}/{target[1]}",
            digest=found.report.sha256,
            format=fmt,
            bytes=found.report.bytes,
            connection=ref.connection,
        )

    def model_facts(self, name: str, account: str) -> plan_inputs.ModelFacts:
        entry = self.store.resolve(name, account) if self.store is not None else None
        if entry is None or self.store is None:
            return plan_inputs.ModelFacts(entry=None)
        config = self.store.path(entry.digest) / "config.json"
        try:
            if config.stat().st_size > MAX_CONFIG_BYTES:
                return plan_inputs.ModelFacts(entry, unsupported=("config.json", "it is too large"))
            hf = shape_from_hf_config(json.loads(config.read_bytes()))
        except UnsupportedConfig as exc:
            return plan_inputs.ModelFacts(entry, unsupported=(exc.key, str(exc)))
        except (OSError, ValueError):
            return plan_inputs.ModelFacts(entry, changed=True)
        return plan_inputs.ModelFacts(entry, changed=hf.shape != entry.shape)

    def _tokenizer_vocab(self, named: str | None) -> int | None:
        if named is None or self.store is None or not plan_inputs.is_digest(named):
            return None
        stored = self.store.tokenizer(named)
        return None if stored is None else stored.vocab
