"""The confirmation service's view of a binding: the one definition lives in
services/domain/binding.py (shared with the ledger's accept script); this names its check here."""

from contracts.api import Action
from contracts.errors import ErrorCode
from services.domain.binding import Stored, Wanted, refusal, refused

__all__ = ["Stored", "check"]


def check(
    stored: Stored,
    *,
    account: str,
    action: Action,
    target: str,
    digest: str | None,
    cost: float | None,
    now: float,
) -> tuple[ErrorCode, str] | None:
    """None when the confirmation authorizes the request; else the refusal, in RULES' order."""
    wanted = Wanted(account=account, action=action, target=target, digest=digest, cost=cost)
    reason = refused(stored, wanted, now)
    return None if reason is None else refusal(reason, stored, wanted)
