"""Pure gate decisions: confirmation binding, booking eligibility and projection, signed eligibility
statements, idempotency keys and request fingerprints."""

import dataclasses
import itertools
from datetime import UTC, datetime, timedelta

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.api import Action
from contracts.booking import Booking, BookingEvent, BookingEventKind, BookingState, Fabric, Topology
from contracts.errors import ErrorCode
from contracts.internal import EligibilityBody, EligibilityQuery, EligibilityStatement
from domain.binding import Stored, check
from runtime.messaging.codec import Refusal
from services.entitlement.projection import STATE_AFTER, eligibility, project
from services.entitlement.statements import sign
from services.scheduler.api import MAX_IDEMPOTENCY_KEY, fingerprint, valid_idempotency_key
from services.scheduler.peers import CLOCK_SKEW, verify_statement

NOW = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)

# --- confirmation binding ---

STORED = Stored(
    account="acct_a",
    action=Action.train,
    target="bk_1",
    digest="d" * 64,
    max_cost=10.0,
    expires_at=1000.0,
    consumed=False,
)
REQUEST = dict(account="acct_a", action=Action.train, target="bk_1", digest="d" * 64, cost=9.0, now=999.0)

BINDING_TABLE = [
    # id, changes to the stored confirmation, changes to the request, expected code
    ("ok", {}, {}, None),
    ("ok-cost-exactly-at-max", {}, {"cost": 10.0}, None),
    ("ok-no-max-cost", {"max_cost": None}, {"cost": 1e9}, None),
    ("ok-no-cost-given", {}, {"cost": None}, None),
    ("ok-no-digest-bound", {"digest": ""}, {"digest": "e" * 64}, None),
    ("ok-no-digest-bound-none-given", {"digest": ""}, {"digest": None}, None),
    ("other-account", {}, {"account": "acct_b"}, "confirmation_mismatch"),
    ("consumed", {"consumed": True}, {}, "confirmation_consumed"),
    ("expired-at-the-instant", {}, {"now": 1000.0}, "confirmation_expired"),
    ("expired-after", {}, {"now": 5000.0}, "confirmation_expired"),
    ("other-action", {}, {"action": Action.cancel}, "confirmation_action_mismatch"),
    ("other-target", {}, {"target": "bk_2"}, "confirmation_mismatch"),
    ("other-digest", {}, {"digest": "e" * 64}, "manifest_digest_mismatch"),
    ("missing-digest", {}, {"digest": None}, "manifest_digest_mismatch"),
    ("cost-over-max", {}, {"cost": 10.01}, "confirmation_mismatch"),
    # order: the account is checked first, so another account learns nothing about the state
    ("order-account-before-consumed", {"consumed": True}, {"account": "acct_b"}, "confirmation_mismatch"),
    ("order-account-before-expired", {}, {"account": "acct_b", "now": 5000.0}, "confirmation_mismatch"),
    ("order-consumed-before-expired", {"consumed": True}, {"now": 5000.0}, "confirmation_consumed"),
    # the action before consumed and expired: the wrong confirmation is wrong whatever became of it
    (
        "order-account-before-action",
        {},
        {"account": "acct_b", "action": Action.cancel},
        "confirmation_mismatch",
    ),
    (
        "order-action-before-consumed",
        {"consumed": True},
        {"action": Action.cancel},
        "confirmation_action_mismatch",
    ),
    (
        "order-action-before-expired",
        {},
        {"now": 5000.0, "action": Action.cancel},
        "confirmation_action_mismatch",
    ),
    (
        "order-action-before-digest",
        {},
        {"action": Action.cancel, "digest": "e" * 64},
        "confirmation_action_mismatch",
    ),
    ("order-digest-before-cost", {}, {"digest": "e" * 64, "cost": 99.0}, "manifest_digest_mismatch"),
]


@pytest.mark.parametrize(
    "stored_changes, request_changes, code", [r[1:] for r in BINDING_TABLE], ids=[r[0] for r in BINDING_TABLE]
)
def test_confirmation_binding(stored_changes, request_changes, code):
    refusal = check(_stored(**stored_changes), **(REQUEST | request_changes))
    assert (None if refusal is None else refusal[0].value) == code
    if refusal is not None:
        assert refusal[1]  # a message a person can read


def _stored(**changes) -> Stored:
    return dataclasses.replace(STORED, **changes)


def test_binding_messages_distinguish_the_mismatches():
    messages = {
        check(_stored(), **(REQUEST | {"account": "acct_b"}))[1],
        check(_stored(), **(REQUEST | {"action": Action.cancel}))[1],
        check(_stored(), **(REQUEST | {"target": "bk_2"}))[1],
        check(_stored(), **(REQUEST | {"cost": 11.0}))[1],
    }
    assert len(messages) == 4


# --- booking eligibility ---

TOPO = Topology(nodes=2, gpus_per_node=8, gpu_model="H200", gpu_memory_gb=141)
WINDOW_END = NOW + timedelta(hours=4)


def booking(**changes) -> Booking:
    base = dict(
        booking_id="bk_1",
        account="acct_a",
        state=BookingState.completed,
        version=2,
        topology=TOPO,
        region="eu-west",
        fabric=Fabric.infiniband,
        window_start=NOW - timedelta(hours=1),
        window_end=WINDOW_END,
        updated_at=NOW - timedelta(hours=1),
    )
    return Booking(**(base | changes))


def query(**changes) -> EligibilityQuery:
    base = dict(account="acct_a", booking_id="bk_1", nodes=2, gpus_per_node=8, region=None, fabric=None)
    return EligibilityQuery(**(base | changes))


ELIGIBILITY_TABLE = [
    # id, booking (None: unknown), query changes, now, parked, expected code
    ("ok", booking(), {}, NOW, False, None),
    ("ok-smaller-than-booked", booking(), {"nodes": 1, "gpus_per_node": 4}, NOW, False, None),
    (
        "ok-region-and-fabric-match",
        booking(),
        {"region": "eu-west", "fabric": Fabric.infiniband},
        NOW,
        False,
        None,
    ),
    ("ok-just-before-window-end", booking(), {}, WINDOW_END - timedelta(microseconds=1), False, None),
    ("unknown", None, {}, NOW, False, "booking_not_found"),
    ("foreign-account", booking(account="acct_b"), {}, NOW, False, "booking_not_found"),
    ("foreign-account-even-if-parked", booking(account="acct_b"), {}, NOW, True, "booking_not_found"),
    (
        "foreign-account-revoked",
        booking(account="acct_b", state=BookingState.revoked),
        {},
        NOW,
        False,
        "booking_not_found",
    ),
    ("parked", None, {}, NOW, True, "booking_incomplete"),
    ("revoked", booking(state=BookingState.revoked), {}, NOW, False, "booking_revoked"),
    ("released", booking(state=BookingState.released), {}, NOW, False, "booking_released"),
    ("expired-state", booking(state=BookingState.expired), {}, NOW, False, "booking_expired"),
    ("window-over-at-the-instant", booking(), {}, WINDOW_END, False, "booking_expired"),
    ("window-over", booking(), {}, WINDOW_END + timedelta(days=1), False, "booking_expired"),
    (
        "revoked-before-window-over",
        booking(state=BookingState.revoked),
        {},
        WINDOW_END + timedelta(days=1),
        False,
        "booking_revoked",
    ),
    ("too-many-nodes", booking(), {"nodes": 3}, NOW, False, "booking_mismatch"),
    ("too-many-gpus", booking(), {"gpus_per_node": 9}, NOW, False, "booking_mismatch"),
    ("other-region", booking(), {"region": "us-east"}, NOW, False, "booking_mismatch"),
    ("other-fabric", booking(), {"fabric": Fabric.ethernet}, NOW, False, "booking_mismatch"),
    (
        "expired-before-size",
        booking(state=BookingState.expired),
        {"nodes": 99},
        NOW,
        False,
        "booking_expired",
    ),
]


@pytest.mark.parametrize(
    "b, query_changes, now, parked, code",
    [r[1:] for r in ELIGIBILITY_TABLE],
    ids=[r[0] for r in ELIGIBILITY_TABLE],
)
def test_eligibility(b, query_changes, now, parked, code):
    refusal = eligibility(b, query(**query_changes), now, parked=parked)
    assert (None if refusal is None else refusal[0].value) == code


def test_foreign_booking_looks_exactly_like_an_unknown_one():
    unknown = eligibility(None, query(), NOW)
    foreign = eligibility(booking(account="acct_b"), query(), NOW)
    assert unknown == foreign
    assert "bk_1" not in foreign[1] and "acct_b" not in foreign[1]


@pytest.mark.parametrize("kind", list(BookingEventKind), ids=lambda k: k.value)
def test_every_event_kind_maps_to_a_state(kind):
    assert kind in STATE_AFTER


@pytest.mark.parametrize(
    "kind, state",
    [
        (BookingEventKind.completed, BookingState.completed),
        (BookingEventKind.modified, BookingState.completed),
        (BookingEventKind.revoked, BookingState.revoked),
        (BookingEventKind.expired, BookingState.expired),
        (BookingEventKind.released, BookingState.released),
    ],
    ids=lambda v: v.value,
)
def test_project_maps_event_kind_to_state_and_copies_the_rest(kind, state):
    event = BookingEvent(
        event_id="ev_9",
        kind=kind,
        booking_id="bk_1",
        account="acct_a",
        version=7,
        topology=TOPO,
        region="eu-west",
        fabric=Fabric.roce,
        window_start=NOW,
        window_end=WINDOW_END,
        emitted_at=NOW + timedelta(seconds=3),
    )
    assert project(event) == Booking(
        booking_id="bk_1",
        account="acct_a",
        state=state,
        version=7,
        topology=TOPO,
        region="eu-west",
        fabric=Fabric.roce,
        window_start=NOW,
        window_end=WINDOW_END,
        updated_at=NOW + timedelta(seconds=3),
    )


# --- signed eligibility statements ---

KEY = b"k" * 32
BODY = EligibilityBody(
    account="acct_a",
    booking_id="bk_1",
    booking_version=2,
    topology=TOPO,
    region="eu-west",
    fabric=Fabric.infiniband,
    window_start=NOW - timedelta(hours=1),
    window_end=WINDOW_END,
    issued_at=NOW,
    expires_at=NOW + timedelta(seconds=30),
)
GOOD = sign(BODY, KEY)


def forged_signature():
    return msgspec.structs.replace(GOOD, signature=sign(BODY, b"x" * 32).signature)


def flipped_signature():
    last = GOOD.signature[-1]
    return msgspec.structs.replace(GOOD, signature=GOOD.signature[:-1] + ("0" if last != "0" else "1"))


def altered(**changes):
    # the body changes after signing; the signature stays the one issued for the original body
    return msgspec.structs.replace(GOOD, body=msgspec.structs.replace(BODY, **changes))


STATEMENT_TABLE = [
    # id, statement, account, booking, now, ok
    ("good", GOOD, "acct_a", "bk_1", NOW, True),
    ("good-within-clock-skew-before-issue", GOOD, "acct_a", "bk_1", NOW - CLOCK_SKEW, True),
    (
        "good-just-before-expiry",
        GOOD,
        "acct_a",
        "bk_1",
        NOW + timedelta(seconds=30) - timedelta(microseconds=1),
        True,
    ),
    ("forged-signature-other-key", forged_signature(), "acct_a", "bk_1", NOW, False),
    ("tampered-signature", flipped_signature(), "acct_a", "bk_1", NOW, False),
    ("empty-signature", msgspec.structs.replace(GOOD, signature=""), "acct_a", "bk_1", NOW, False),
    (
        "altered-body-more-gpus",
        altered(topology=Topology(nodes=64, gpus_per_node=8, gpu_model="H200", gpu_memory_gb=141)),
        "acct_a",
        "bk_1",
        NOW,
        False,
    ),
    (
        "altered-body-later-expiry",
        altered(expires_at=NOW + timedelta(days=365)),
        "acct_a",
        "bk_1",
        NOW + timedelta(hours=1),
        False,
    ),
    ("other-account", GOOD, "acct_b", "bk_1", NOW, False),
    ("other-booking", GOOD, "acct_a", "bk_2", NOW, False),
    ("expired-at-the-instant", GOOD, "acct_a", "bk_1", NOW + timedelta(seconds=30), False),
    ("expired", GOOD, "acct_a", "bk_1", NOW + timedelta(hours=1), False),
    (
        "issued-in-the-future-beyond-skew",
        GOOD,
        "acct_a",
        "bk_1",
        NOW - CLOCK_SKEW - timedelta(microseconds=1),
        False,
    ),
]


@pytest.mark.parametrize(
    "stmt, account, booking_id, now, ok",
    [r[1:] for r in STATEMENT_TABLE],
    ids=[r[0] for r in STATEMENT_TABLE],
)
def test_verify_statement(stmt, account, booking_id, now, ok):
    if ok:
        assert verify_statement(stmt, KEY, account, booking_id, now) == BODY
    else:
        with pytest.raises(Refusal) as info:
            verify_statement(stmt, KEY, account, booking_id, now)
        assert info.value.code is ErrorCode.eligibility_stale


def test_a_statement_survives_the_wire():
    decoded = msgspec.json.decode(msgspec.json.encode(GOOD), type=EligibilityStatement)
    assert verify_statement(decoded, KEY, "acct_a", "bk_1", NOW) == BODY


def test_refusal_never_shows_the_key_or_signature():
    with pytest.raises(Refusal) as info:
        verify_statement(forged_signature(), KEY, "acct_a", "bk_1", NOW)
    leaked = KEY.decode() in info.value.message or GOOD.signature in info.value.message
    assert not leaked, "the refusal message must not carry key material"


# --- idempotency keys ---

KEY_TABLE = [
    ("one-char", "a", True),
    ("uuid", "3f1c2a9e-7b0d-4c55-9e1a-2b3c4d5e6f70", True),
    ("space-and-tilde-are-printable", " ~", True),
    ("max-length", "k" * MAX_IDEMPOTENCY_KEY, True),
    ("empty", "", False),
    ("one-over-max", "k" * (MAX_IDEMPOTENCY_KEY + 1), False),
    ("newline", "abc\n", False),
    ("tab", "a\tb", False),
    ("nul", "a\x00b", False),
    ("del", "a\x7f", False),
    ("non-ascii", "clé", False),
    ("emoji", "run-\U0001f680", False),
]


@pytest.mark.parametrize("key, ok", [r[1:] for r in KEY_TABLE], ids=[r[0] for r in KEY_TABLE])
def test_valid_idempotency_key(key, ok):
    assert valid_idempotency_key(key) is ok


PROPERTY = settings(max_examples=300, deadline=None, database=None)


@PROPERTY
@given(st.text(max_size=300))
def test_idempotency_key_accepted_iff_1_to_255_printable_ascii(key):
    expected = 1 <= len(key) <= 255 and all(32 <= ord(c) <= 126 for c in key)
    assert valid_idempotency_key(key) is expected


@PROPERTY
@given(st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=255))
def test_every_printable_ascii_key_up_to_255_is_accepted(key):
    assert valid_idempotency_key(key)


# --- fingerprints ---

FP_ARGS = (Action.train, "acct_a", "bk_1", "d" * 64)


def test_fingerprint_is_deterministic_sha256_hex():
    fp = fingerprint(*FP_ARGS)
    assert fp == fingerprint(*FP_ARGS)
    assert len(fp) == 64 and all(c in "0123456789abcdef" for c in fp)


@pytest.mark.parametrize(
    "index, other",
    [(0, Action.cancel), (1, "acct_b"), (2, "bk_2"), (3, "e" * 64)],
    ids=["action", "account", "target", "digest"],
)
def test_fingerprint_differs_per_field(index, other):
    args = list(FP_ARGS)
    args[index] = other
    assert fingerprint(*args) != fingerprint(*FP_ARGS)


def test_fingerprint_fields_do_not_run_together():
    # "ab" + "c" must not collide with "a" + "bc": fields are separated
    assert fingerprint(Action.train, "ab", "c", "d") != fingerprint(Action.train, "a", "bc", "d")


def test_fingerprints_of_all_actions_are_distinct():
    fps = [fingerprint(a, "acct_a", "bk_1", "d") for a in Action]
    assert len(set(fps)) == len(fps)
    assert all(x != y for x, y in itertools.combinations(fps, 2))


@pytest.mark.parametrize(
    "confirmed, asked, target, command",
    [
        (Action.train, Action.cancel, "run_1", "ecc ito confirm --action cancel --run run_1"),
        (
            Action.cleanup,
            Action.release_booking,
            "bk_1",
            "ecc ito confirm --action release_booking --booking bk_1",
        ),
        (
            Action.cancel,
            Action.train,
            "bk_1",
            "ecc ito confirm --action train --booking bk_1 --manifest MANIFEST",
        ),
        (
            Action.train,
            Action.restart_from_checkpoint,
            "run 2",
            "ecc ito confirm --action restart_from_checkpoint --run 'run 2'",
        ),
    ],
)
def test_another_actions_confirmation_names_both_actions_and_the_command(confirmed, asked, target, command):
    refusal = check(
        _stored(action=confirmed, consumed=True), **(REQUEST | {"action": asked, "target": target})
    )
    assert refusal is not None
    code, message = refusal
    assert code.value == "confirmation_action_mismatch"
    assert message == (
        f"this confirmation is for action {confirmed.value}, not {asked.value}: get one for {asked.value} "
        f"with `{command}`"
    )
