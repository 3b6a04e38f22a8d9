"""The manifest's inputs as they are now: the base model in the model store, the tokenizer, the data
files. Gathered here (I/O) and judged by the pure checks in services/domain/plan_inputs.py, each time
a manifest is planned, confirmed or trained: unlike the manifest's bytes, the store and the files
can change between two requests, so a manifest whose digest passed before proves nothing about them.

Cheap by construction: the store is read through small files (names.json, MODEL.json, config.json;
the weights are never re-hashed here, the trainer does that with `ModelStore.verify` before it
loads), and a data file's sha256 and columns are remembered by (path, size, mtime_ns, inode), so an
unchanged file is hashed once.
"""

import json
import os
import pathlib
import threading
from collections import OrderedDict

from contracts.errors import ErrorCode
from contracts.manifest import DataFormat, DataRef, DataRole, Manifest
from contracts.models import BaseModel
from services.domain import plan_inputs
from services.domain.curriculum import Curriculum, curriculum_of
from services.domain.data_schemas import file_format, reads_rows
from services.domain.model_shapes import UnsupportedConfig, shape_from_hf_config
from services.runtime.messaging.codec import Refusal
from services.runtime.storage.data_files import schema_of, sha256_file
from services.runtime.storage.model_store import MAX_CONFIG_BYTES, ModelStore

FILES_KEPT = 1024  # data files whose digest and columns are remembered


def _refuse(refusal: plan_inputs.Refusal | None) -> None:
    if refusal is not None:
        raise Refusal(*refusal)


class ManifestInputs:
    """Resolves and checks a manifest's base model, tokenizer and data files (see the module doc)."""

    def __init__(self, store: ModelStore | None) -> None:
        self.store = store
        self._lock = threading.Lock()  # the API checks inputs in worker threads
        self._files: OrderedDict[tuple[str, int, int, int, DataFormat | None], plan_inputs.FileFacts] = (
            OrderedDict()
        )

    def runnable(self, manifest: Manifest, account: str) -> tuple[Curriculum, BaseModel | None]:
        """The curriculum and the resolved base model, or a Refusal: the model's codes first, then
        the manifest's own (`manifest_invalid`), the tokenizer, the data files in manifest order."""
        spec = manifest.model
        base = None
        if spec.base is not None and spec.size is None:
            facts = self.model_facts(spec.base, account)
            _refuse(plan_inputs.model_refusal(spec, facts))
            base = facts.entry
        try:
            plan = curriculum_of(manifest, base)
        except ValueError as exc:
            raise Refusal(ErrorCode.manifest_invalid, f"the manifest cannot run: {exc}") from None
        assert plan.shape is not None, "curriculum_of sets the starting shape"
        _refuse(plan_inputs.tokenizer_refusal(spec, plan.shape, base, self._tokenizer_vocab(spec.tokenizer)))
        readers: dict[str, list[str]] = {}
        for stage in plan.stages:
            for name in stage.data:
                readers.setdefault(name, []).append(stage.name)
        for i, ref in enumerate(manifest.data):
            if not ref.source.startswith("file:") or (ref.digest is None and not reads_rows(ref)):
                continue
            stages = ["eval"] if ref.role is DataRole.eval else readers.get(ref.name, [])
            _refuse(plan_inputs.data_refusal(i, ref, stages, self.file_facts(ref)))
        return plan, base

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

    def file_facts(self, ref: DataRef) -> plan_inputs.FileFacts:
        """The ref's file digest (and columns when it is read by column), remembered while the
        file is unchanged."""
        path = pathlib.Path(ref.source.removeprefix("file:"))
        fmt = file_format(ref) if reads_rows(ref) else None
        try:
            st = os.stat(path)
        except OSError:
            return plan_inputs.FileFacts(digest=None)
        key = (str(path), st.st_size, st.st_mtime_ns, st.st_ino, fmt)
        with self._lock:
            known = self._files.get(key)
            if known is not None:
                self._files.move_to_end(key)
                return known
        try:
            digest = sha256_file(path)
        except OSError:
            return plan_inputs.FileFacts(digest=None)
        facts = plan_inputs.FileFacts(digest=digest)
        if fmt is not None:
            try:
                facts = plan_inputs.FileFacts(digest=digest, columns=schema_of(path, fmt).columns)
            except ValueError as exc:
                facts = plan_inputs.FileFacts(digest=digest, unreadable=str(exc))
        with self._lock:
            self._files[key] = facts
            if len(self._files) > FILES_KEPT:
                self._files.popitem(last=False)
        return facts
