"""What a confirmation binds, defined once: the record's fields, the checks in their order, each
check's stable code and message, and the same checks in Lua for the ledger's atomic accept script.

The confirmation service owns the record: it alone creates it (services/confirmation/store.py) and
resolves a reference against a request with `refused` (the precise refusal, before anything is
consumed). The ledger only reads it and consumes it: its accept script (services/ledger/store.py)
runs `lua_checks()`, generated from the same `RULES`, and returns the failed rule's name, which
`refusal` turns into the same code and message the confirmation service gives. So the two can
never disagree on what a binding is, nor in which order it is checked.
"""

import enum
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from contracts.api import BOOKING_ACTIONS, FILE_ACTIONS, Action
from contracts.errors import ErrorCode

FIELDS = ("account", "action", "target", "digest", "max_cost", "expires_at", "consumed")
"""The record's hash fields, in the order the script reads them (HMGET)."""


@dataclass(frozen=True, slots=True)
class Stored:
    """A confirmation record as the confirmation service wrote it."""

    account: str
    action: Action
    target: str
    digest: str  # "" when the action binds no manifest
    max_cost: float | None
    expires_at: float  # epoch seconds, the Redis server's clock
    consumed: bool

    def fields(self) -> dict[str, str]:
        """The record as stored (one string per name in FIELDS)."""
        return {
            "account": self.account,
            "action": self.action.value,
            "target": self.target,
            "digest": self.digest,
            "max_cost": encode_cost(self.max_cost),
            "expires_at": repr(self.expires_at),
            "consumed": "1" if self.consumed else "0",
        }

    @classmethod
    def from_fields(cls, values: Sequence[str]) -> "Stored":
        """The record from its field values, in FIELDS order."""
        f = dict(zip(FIELDS, values, strict=True))
        return cls(
            account=f["account"],
            action=Action(f["action"]),
            target=f["target"],
            digest=f["digest"],
            max_cost=float(f["max_cost"]) if f["max_cost"] else None,
            expires_at=float(f["expires_at"]),
            consumed=f["consumed"] == "1",
        )


@dataclass(frozen=True, slots=True)
class Wanted:
    """What a request asks the confirmation to authorize."""

    account: str
    action: Action
    target: str
    digest: str | None  # the manifest's, for a train
    cost: float | None  # the estimate, for a train


def encode_cost(value: float | None) -> str:
    return "" if value is None else repr(float(value))


class Reason(enum.StrEnum):
    """Why a confirmation does not authorize a request: the name the script returns."""

    not_found = "not_found"
    account = "account"
    consumed = "consumed"
    expired = "expired"
    action = "action"
    target = "target"
    digest = "digest"
    cost = "cost"


@dataclass(frozen=True, slots=True)
class Rule:
    reason: Reason
    refuses: Callable[[Stored, Wanted, float], bool]
    """The check in Python: does it refuse (stored, wanted, now)?"""
    lua: str
    """The same check in the script: `c.<field>` is the record, `want.<field>` the request, `now`."""


RULES: tuple[Rule, ...] = (  # checked in this order, the first failing one answers
    # The account first, so another account learns nothing about the record. The action next: a
    # confirmation for another action is the wrong one whatever became of it, and `confirm again`
    # (consumed, expired) would send the person back for the same wrong one.
    Rule(Reason.account, lambda s, w, now: s.account != w.account, "c.account ~= want.account"),
    Rule(Reason.action, lambda s, w, now: s.action != w.action, "c.action ~= want.action"),
    Rule(Reason.consumed, lambda s, w, now: s.consumed, "c.consumed == '1'"),
    Rule(Reason.expired, lambda s, w, now: now >= s.expires_at, "now >= tonumber(c.expires_at)"),
    Rule(Reason.target, lambda s, w, now: s.target != w.target, "c.target ~= want.target"),
    Rule(
        Reason.digest,
        lambda s, w, now: bool(s.digest) and s.digest != (w.digest or ""),
        "c.digest ~= '' and c.digest ~= want.digest",
    ),
    Rule(
        Reason.cost,
        lambda s, w, now: s.max_cost is not None and w.cost is not None and w.cost > s.max_cost,
        "c.max_cost ~= '' and want.cost ~= '' and tonumber(want.cost) > tonumber(c.max_cost)",
    ),
)

CODES: dict[Reason, ErrorCode] = {
    Reason.not_found: ErrorCode.confirmation_not_found,
    Reason.account: ErrorCode.confirmation_mismatch,
    Reason.consumed: ErrorCode.confirmation_consumed,
    Reason.expired: ErrorCode.confirmation_expired,
    Reason.action: ErrorCode.confirmation_action_mismatch,
    Reason.target: ErrorCode.confirmation_mismatch,
    Reason.digest: ErrorCode.manifest_digest_mismatch,
    Reason.cost: ErrorCode.confirmation_mismatch,
}


def refused(stored: Stored, wanted: Wanted, now: float) -> Reason | None:
    """The first rule the request fails, or None when the confirmation authorizes it."""
    return next((rule.reason for rule in RULES if rule.refuses(stored, wanted, now)), None)


def refusal(reason: Reason, stored: Stored | None, wanted: Wanted) -> tuple[ErrorCode, str]:
    """The code and the message safe to show, for either service."""
    match reason:
        case Reason.not_found:
            message = "no such confirmation for this account"
        case Reason.account:
            message = "this confirmation belongs to another account"
        case Reason.consumed:
            message = "this confirmation was already used; confirm again"
        case Reason.expired:
            message = "this confirmation expired; confirm again"
        case Reason.action:
            made_for = f"action {stored.action.value}" if stored is not None else "another action"
            message = (
                f"this confirmation is for {made_for}, not {wanted.action.value}: get one for "
                f"{wanted.action.value} with `{confirm_command(wanted.action, wanted.target)}`"
            )
        case Reason.target:
            message = "this confirmation is for another target"
        case Reason.digest:
            message = "the manifest changed since it was confirmed; review and confirm again"
        case Reason.cost:
            confirmed = stored.max_cost if stored is not None and stored.max_cost is not None else 0.0
            message = (
                f"the estimated cost {wanted.cost or 0.0:.2f} USD is above the confirmed {confirmed:.2f} USD"
            )
    return CODES[reason], message


def confirm_command(action: Action, target: str) -> str:
    """The `ecc ito confirm` command that makes a confirmation for `action` on `target` (a train's
    manifest is the person's own path, named by a placeholder); no secret is in it."""
    words = ["ecc", "ito", "confirm", "--action", action.value]
    flag = "--booking" if action in BOOKING_ACTIONS else "--file" if action in FILE_ACTIONS else "--run"
    words += [flag, shlex.quote(target)]
    if action is Action.train:
        words += ["--manifest", "MANIFEST"]
    return " ".join(words)


def lua_checks() -> str:
    """The script's checks, from RULES: expects `conf` (the HMGET of FIELDS), `want` (a table of
    the request's fields as strings: cost "" when none) and `now`; returns the failed rule's name
    and the record's fields."""
    lines = [
        "if not conf[1] then return {'refused', '" + Reason.not_found.value + "'} end",
        "local c = {}",
        "for i, name in ipairs({" + ", ".join(f"'{f}'" for f in FIELDS) + "}) do c[name] = conf[i] end",
    ]
    for rule in RULES:
        lines.append(f"if {rule.lua} then return {{'refused', '{rule.reason.value}', unpack(conf)}} end")
    return "\n".join(lines)


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
