"""Export, download and sample: a trained model a user can take home, and try first.

None of them spends a booking or changes a run, so none takes a confirmation or an idempotency
key: export is idempotent by its own id (`<stage>-<format>`), download and sample only read. Each
follows cleanup's pattern: authenticate -> the run, the caller's account's (else `run_not_found`)
-> its stored work item (the reviewed manifest and the resolved base model) -> one signed order to
a trainer (services/trainer/exports.py, sampling.py), whose answer is the verb's.
"""

import msgspec

from contracts.api import RunView
from contracts.errors import ErrorCode
from contracts.exports import (
    DownloadChunk,
    DownloadOrder,
    DownloadRequest,
    ExportOrder,
    ExportRequest,
    ExportView,
    SampleOrder,
    SampleRequest,
    SampleResult,
)
from contracts.manifest import Manifest
from contracts.runs import TrainWork
from runtime.messaging.codec import Refusal
from runtime.tenancy.accounts import Credentials
from services.scheduler.admission import authenticate
from services.scheduler.peers import Peers
from services.scheduler.store import RunRecords

_work_decoder = msgspec.json.Decoder(TrainWork)
_manifest_decoder = msgspec.json.Decoder(Manifest)


class Outputs:
    def __init__(self, credentials: Credentials, peers: Peers, runs: RunRecords) -> None:
        self.credentials = credentials
        self.peers = peers
        self.runs = runs

    async def _run(self, caller: str, req, run_id: str) -> tuple[str, RunView, TrainWork, str]:
        """(account, the run's view, its work item, the manifest's checkpoint storage)."""
        account = (await authenticate(self.credentials, caller, req)).account
        view = await self.runs.get(account, run_id)
        if view is None:
            raise Refusal(ErrorCode.run_not_found, "no such run for this account")
        if view.cleaned_up:
            raise Refusal(ErrorCode.export_not_found, "the run was cleaned up: its checkpoints are gone")
        stored = await self.runs.recall(account, run_id, "work")
        if stored is None:
            raise Refusal(ErrorCode.export_not_found, "the run has no committed checkpoint yet")
        work = _work_decoder.decode(stored)
        storage = _manifest_decoder.decode(work.manifest_text.encode()).checkpoint.storage
        return account, view, work, storage

    async def export(self, caller: str, req: ExportRequest) -> ExportView:
        account, view, work, storage = await self._run(caller, req, req.run_id)
        order = ExportOrder(
            account=account,
            run_id=req.run_id,
            stage=req.stage,
            format=req.format,
            manifest_digest=view.manifest_digest,
            storage=storage,
            manifest_text=work.manifest_text,
            base=work.base,
            gates=view.gates,
            checkpoint_dir=view.checkpoint_dir or "",
        )
        return await self.peers.trainer_export(order)

    async def download(self, caller: str, req: DownloadRequest) -> DownloadChunk:
        account, _, _, storage = await self._run(caller, req, req.run_id)
        order = DownloadOrder(
            account=account,
            run_id=req.run_id,
            export_id=req.export_id,
            path=req.path,
            offset=req.offset,
            length=req.length,
            storage=storage,
        )
        return await self.peers.trainer_download(order)

    async def sample(self, caller: str, req: SampleRequest) -> SampleResult:
        account, view, work, storage = await self._run(caller, req, req.run_id)
        order = SampleOrder(
            account=account,
            run_id=req.run_id,
            request=msgspec.structs.replace(req, credential=None),
            storage=storage,
            manifest_text=work.manifest_text,
            base=work.base,
            checkpoint_dir=view.checkpoint_dir or "",
        )
        return await self.peers.trainer_sample(order)
