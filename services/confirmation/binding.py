"""The pure decision: does a stored confirmation authorize this exact request?"""

from dataclasses import dataclass

from contracts.api import Action
from contracts.errors import ErrorCode


@dataclass(frozen=True, slots=True)
class Stored:
    account: str
    action: Action
    target: str
    digest: str  # "" when the action binds no manifest
    max_cost: float | None
    expires_at: float
    consumed: bool


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
    """None when the confirmation authorizes the request; else the refusal, in a fixed order."""
    if stored.account != account:
        return ErrorCode.confirmation_mismatch, "this confirmation belongs to another account"
    if stored.consumed:
        return ErrorCode.confirmation_consumed, "this confirmation was already used; confirm again"
    if now >= stored.expires_at:
        return ErrorCode.confirmation_expired, "this confirmation expired; confirm again"
    if stored.action != action:
        return ErrorCode.confirmation_mismatch, f"this confirmation is for action {stored.action.value}"
    if stored.target != target:
        return ErrorCode.confirmation_mismatch, "this confirmation is for another target"
    if stored.digest and stored.digest != (digest or ""):
        return (
            ErrorCode.manifest_digest_mismatch,
            "the manifest changed since it was confirmed; review and confirm again",
        )
    if stored.max_cost is not None and cost is not None and cost > stored.max_cost:
        return ErrorCode.confirmation_mismatch, (
            f"the estimated cost {cost:.2f} USD is above the confirmed {stored.max_cost:.2f} USD"
        )
    return None
