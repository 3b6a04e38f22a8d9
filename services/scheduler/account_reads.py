"""What a tenant may ask about its own account before it plans a run: `auth` (who it is, its
quotas and what it uses of them now), `find` (its bookings, and whether each allows training) and
`models` (the base models it may name).

Each reads the authenticated account's own records only, and nothing here writes: `auth` takes
nothing from the request-rate bucket (a take of cost 0 reads what is left).
"""

from datetime import UTC, datetime

import msgspec

from contracts.api import (
    AuthInfo,
    AuthRequest,
    BookingView,
    FindRequest,
    ModelList,
    ModelsRequest,
    ModelView,
    QuotaStatus,
    QuotaUsage,
)
from contracts.booking import Booking, BookingState
from contracts.models import BaseModel
from domain import quotas as quota_rules
from runtime.messaging.codec import Refusal
from runtime.storage.model_store import ModelStore
from runtime.tenancy.accounts import Credentials
from runtime.tenancy.quota_stores import Quotas
from services.scheduler.admission import authenticate
from services.scheduler.file_records import FileRecords
from services.scheduler.peers import Peers
from services.scheduler.store import RunRecords


def model_view(m: BaseModel) -> ModelView:
    return ModelView(
        name=m.name,
        digest=m.digest,
        family=m.family,
        architecture=m.architecture,
        parameters=m.parameters,
        vocab_size=m.shape.vocab_size,
        max_seq_len=m.shape.max_seq_len,
        tokenizer=m.tokenizer_vocab is not None,
        chat_template=m.chat_template,
        bytes=m.bytes,
    )


def booking_view(b: Booking, now: datetime) -> BookingView:
    """A booking as `find` shows it: a completed one allows training until its window ends."""
    allows = b.state is BookingState.completed and now < b.window_end
    reason = None if allows else ("window over" if b.state is BookingState.completed else b.state.value)
    return BookingView(booking=b, allows_training=allows, reason=reason)


class AccountReads:
    def __init__(
        self,
        credentials: Credentials,
        quotas: Quotas,
        runs: RunRecords,
        peers: Peers,
        files: FileRecords | None = None,
        model_store: ModelStore | None = None,
    ) -> None:
        self.credentials = credentials
        self.quotas = quotas
        self.runs = runs
        self.peers = peers
        self.files = files  # None: no uploads (handler tests without the upload port)
        self.model_store = model_store  # None: no base model is listed

    async def auth(self, caller: str, req: AuthRequest) -> AuthInfo:
        """Who the caller is, with its quotas: the limits and what it uses now."""
        info = await authenticate(self.credentials, caller, req)
        limits = await self.quotas.limits(info.account)
        taken = await self.quotas.take(info.account, cost=0)
        unfinished, waiting = quota_rules.run_usage(await self.runs.open_states(info.account))
        try:
            outstanding: int | None = (await self.peers.outstanding_confirmations(info.account)).confirmations
        except Refusal:  # the confirmation service is away: `auth` still says who the caller is
            outstanding = None
        stored = await self.files.usage(info.account) if self.files is not None else {}
        usage = QuotaUsage(
            tokens=round(taken.tokens, 2),
            confirmations=outstanding,
            runs=unfinished,
            queued=waiting,
            file_bytes=stored.get("file_bytes", 0),
            files=stored.get("files", 0),
            models=stored.get("models", 0),
        )
        return msgspec.structs.replace(info, quotas=QuotaStatus(limits=limits, usage=usage))

    async def find(self, caller: str, req: FindRequest) -> list[BookingView]:
        account = (await authenticate(self.credentials, caller, req)).account
        now = datetime.now(UTC)
        return [booking_view(b, now) for b in (await self.peers.bookings(account)).bookings]

    async def models(self, caller: str, req: ModelsRequest) -> ModelList:
        """The base models this account may name (never another account's)."""
        account = (await authenticate(self.credentials, caller, req)).account
        listed = self.model_store.list(account) if self.model_store is not None else []
        return ModelList(models=[model_view(m) for m in listed])
