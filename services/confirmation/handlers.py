"""Confirmation handlers: create a capability; resolve a reference against a request."""

from datetime import UTC, datetime

from contracts.api import ConfirmationIssued
from contracts.errors import ErrorCode
from contracts.internal import ConfirmationCreate, ConfirmationResolve
from services.confirmation import binding
from services.confirmation.store import ConfirmationStore, new_ref
from services.runtime.codec import Refusal


def _issued(ref: str, s: binding.Stored) -> ConfirmationIssued:
    return ConfirmationIssued(
        confirmation_ref=ref,
        action=s.action,
        target=s.target,
        manifest_digest=s.digest or None,
        max_cost_usd=s.max_cost,
        expires_at=datetime.fromtimestamp(s.expires_at, UTC),
    )


class ConfirmationHandlers:
    def __init__(self, store: ConfirmationStore, ttl_s: float) -> None:
        self.store = store
        self.ttl_s = ttl_s

    async def create(self, req: ConfirmationCreate) -> ConfirmationIssued:
        ref = new_ref()
        stored = binding.Stored(
            account=req.account,
            action=req.action,
            target=req.target,
            digest=req.manifest_digest or "",
            max_cost=req.max_cost_usd,
            expires_at=await self.store.now() + self.ttl_s,
            consumed=False,
        )
        await self.store.create(ref, stored)
        return _issued(ref, stored)

    async def resolve(self, req: ConfirmationResolve) -> ConfirmationIssued:
        stored = await self.store.get(req.account, req.confirmation_ref)
        if stored is None:
            owner = await self.store.owner(req.confirmation_ref)
            if owner is not None and owner != req.account:
                raise Refusal(ErrorCode.confirmation_mismatch, "this confirmation belongs to another account")
            raise Refusal(ErrorCode.confirmation_not_found, "no such confirmation for this account")
        refusal = binding.check(
            stored,
            account=req.account,
            action=req.action,
            target=req.target,
            digest=req.manifest_digest,
            cost=req.cost_usd,
            now=await self.store.now(),
        )
        if refusal is not None:
            raise Refusal(*refusal)
        return _issued(req.confirmation_ref, stored)
