"""Confirmation handlers: create a capability; resolve a reference against a request.

The handlers take their records through the `Confirmations` port (Redis in the service, a dict in
table tests); the binding's rules are domain/binding.py's."""

from datetime import UTC, datetime

from contracts.api import ConfirmationIssued
from contracts.internal import ConfirmationCreate, ConfirmationResolve, Outstanding, OutstandingQuery
from domain import binding
from domain.quotas import DEFAULTS, confirmation_breach
from runtime.messaging.codec import Refusal
from runtime.tenancy.quota_stores import Quotas, breach_refusal
from services.confirmation.store import Confirmations, new_ref


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
    def __init__(self, store: Confirmations, ttl_s: float, quotas: Quotas | None = None) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.quotas = quotas  # None: every account has the default limits

    async def _limit(self, account: str) -> int:
        limits = DEFAULTS if self.quotas is None else await self.quotas.limits(account)
        return limits.confirmations

    async def outstanding(self, req: OutstandingQuery) -> Outstanding:
        limit = await self._limit(req.account)
        _, count = await self.store.admit(req.account, "", 0.0, limit)
        return Outstanding(confirmations=count, limit=limit)

    async def create(self, req: ConfirmationCreate) -> ConfirmationIssued:
        """Within the account's `confirmations` quota (counted and admitted in one step), or
        `quota_exceeded` with nothing written."""
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
        limit = await self._limit(req.account)
        admitted, count = await self.store.admit(req.account, ref, stored.expires_at, limit)
        refusal = None if admitted else breach_refusal(confirmation_breach(count, limit))
        if refusal is not None:
            raise refusal
        await self.store.create(ref, stored)
        return _issued(ref, stored)

    async def resolve(self, req: ConfirmationResolve) -> ConfirmationIssued:
        wanted = binding.Wanted(
            account=req.account,
            action=req.action,
            target=req.target,
            digest=req.manifest_digest,
            cost=req.cost_usd,
        )
        stored, now = await self.store.get_at(req.account, req.confirmation_ref)
        if stored is None:
            owner = await self.store.owner(req.confirmation_ref)
            missing = binding.Reason.account if owner not in (None, req.account) else binding.Reason.not_found
            raise Refusal(*binding.refusal(missing, None, wanted))
        reason = binding.refused(stored, wanted, now)
        if reason is not None:
            raise Refusal(*binding.refusal(reason, stored, wanted))
        return _issued(req.confirmation_ref, stored)
