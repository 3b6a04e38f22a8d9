"""The confirmation and ledger handlers as a table, on both adapters of their ports: in memory
(milliseconds, no Redis) and Redis (the ledger's Lua script), on one server and on a Redis
Cluster. The same rows must give the same error code and the same typed reason on both, and the
ledger's refusal must be the confirmation service's own, word for word: the binding is defined
once (domain/binding.py)."""

import dataclasses
import uuid

import msgspec
import pytest

from contracts.api import Action
from contracts.errors import ErrorCode
from contracts.internal import (
    ConfirmationCreate,
    ConfirmationResolve,
    LedgerAccept,
    LedgerHandedOff,
    LedgerLookup,
)
from domain import binding
from runtime.configuration.keys import Keys
from runtime.messaging.codec import Refusal
from services.confirmation.handlers import ConfirmationHandlers
from services.confirmation.store import ConfirmationStore, InMemoryConfirmations
from services.ledger.handlers import LedgerHandlers
from services.ledger.store import InMemoryLedger, LedgerStore
from tests.conftest import new_namespace, start_infra
from tests.training.test_node_shares import work as _node_work

DIGEST = "d" * 64

WORK = msgspec.json.encode(_node_work(1, rendezvous=""))  # a train's item: the ledger writes its bound in


@pytest.fixture(scope="module")
def redis_infra(tmp_path_factory):
    i = start_infra(tmp_path_factory.mktemp("binding") / "infra", new_namespace(), nats=False)
    yield i
    i.stop()


@dataclasses.dataclass
class Services:
    confirmations: ConfirmationHandlers
    ledger: LedgerHandlers
    records: InMemoryConfirmations | ConfirmationStore


@pytest.fixture(params=["memory", "redis", "cluster"])
async def services(request):
    if request.param == "memory":
        records = InMemoryConfirmations()
        yield Services(
            ConfirmationHandlers(records, ttl_s=600),
            LedgerHandlers(InMemoryLedger(records.records, clock=records.clock)),
            records,
        )
        return
    infra = request.getfixturevalue("redis_infra" if request.param == "redis" else "cluster_infra")
    rc, rl = infra.redis("confirmation"), infra.redis("ledger")  # each service's own ACL user
    keys = Keys(infra.settings)
    store = ConfirmationStore(rc, keys)
    yield Services(
        ConfirmationHandlers(store, ttl_s=600), LedgerHandlers(LedgerStore(rl, keys, retention_s=3600)), store
    )
    await rc.aclose()
    await rl.aclose()


async def issue(s: Services, account: str = "acme", **changes) -> str:
    create = ConfirmationCreate(
        account=account, action=Action.train, target="b1", manifest_digest=DIGEST, max_cost_usd=10.0
    )
    issued = await s.confirmations.create(msgspec.structs.replace(create, **changes))
    return issued.confirmation_ref


def requests(ref: str, account: str, **changes) -> tuple[ConfirmationResolve, LedgerAccept]:
    fields = {
        "account": account,
        "confirmation_ref": ref,
        "action": Action.train,
        "target": "b1",
        "manifest_digest": DIGEST,
        "cost_usd": 5.0,
        **changes,
    }
    key = "k_" + uuid.uuid4().hex[:8]
    accept = LedgerAccept(idempotency_key=key, fingerprint="f", run_id="run_" + key, work=WORK, **fields)
    return ConfirmationResolve(**fields), accept


async def refusal_of(call) -> Refusal | None:
    try:
        await call
    except Refusal as refusal:
        return refusal
    return None


ROWS = [  # (what the request changes, the reason, the code)
    ({}, None, None),
    ({"action": Action.cancel}, binding.Reason.action, ErrorCode.confirmation_action_mismatch),
    ({"target": "b2"}, binding.Reason.target, ErrorCode.confirmation_mismatch),
    ({"manifest_digest": "e" * 64}, binding.Reason.digest, ErrorCode.manifest_digest_mismatch),
    ({"cost_usd": 10.5}, binding.Reason.cost, ErrorCode.confirmation_mismatch),
    ({"cost_usd": 10.0}, None, None),  # exactly the confirmed cost
    ({"confirmation_ref": "cf_unknown"}, binding.Reason.not_found, ErrorCode.confirmation_not_found),
]


@pytest.mark.parametrize("changes, reason, code", ROWS)
async def test_resolve_and_accept_refuse_alike(services, changes, reason, code):
    account = "a" + uuid.uuid4().hex[:6]
    ref = await issue(services, account)
    resolve, accept = requests(ref, account, **changes)
    by_confirmation = await refusal_of(services.confirmations.resolve(resolve))
    by_ledger = await refusal_of(services.ledger.accept(accept))
    if code is None:
        assert by_confirmation is None and by_ledger is None
        return
    assert by_confirmation is not None and by_ledger is not None
    assert by_confirmation.code is code and by_ledger.code is code
    stored = await services.records.get(account, ref)
    wanted = binding.Wanted(
        account=account,
        action=resolve.action,
        target=resolve.target,
        digest=resolve.manifest_digest,
        cost=resolve.cost_usd,
    )
    assert binding.refusal(reason, stored, wanted)[0] is code
    assert by_ledger.message == by_confirmation.message  # one definition, not a copy


async def test_a_consumed_confirmation_is_refused_by_both(services):
    account = "a" + uuid.uuid4().hex[:6]
    ref = await issue(services, account)
    resolve, accept = requests(ref, account)
    _, note = await services.ledger.accept(accept)
    assert note is None  # created, not a replay
    second = msgspec.structs.replace(accept, idempotency_key="other", run_id="run_other")
    for call in (services.confirmations.resolve(resolve), services.ledger.accept(second)):
        refusal = await refusal_of(call)
        assert refusal is not None and refusal.code is ErrorCode.confirmation_consumed
    stored = await services.records.get(account, ref)
    assert stored is not None and stored.consumed is True


async def test_a_replay_returns_the_entry_without_consuming_again(services):
    account = "a" + uuid.uuid4().hex[:6]
    ref = await issue(services, account)
    _, accept = requests(ref, account)
    first, _ = await services.ledger.accept(accept)
    again, note = await services.ledger.accept(accept)
    assert (again.run_id, again.handed_off, note is not None) == (first.run_id, False, True)
    handed = await services.ledger.handed_off(
        LedgerHandedOff(account=account, idempotency_key=accept.idempotency_key)
    )
    looked = await services.ledger.lookup(
        LedgerLookup(account=account, idempotency_key=accept.idempotency_key)
    )
    assert handed.handed_off is True and looked is not None and looked.run_id == first.run_id


async def test_an_expired_confirmation_is_refused_by_both(services):
    account = "a" + uuid.uuid4().hex[:6]
    ref = await issue(services, account)
    stored = await services.records.get(account, ref)
    assert stored is not None
    await services.records.create(
        ref, dataclasses.replace(stored, expires_at=await services.records.now() - 1)
    )
    resolve, accept = requests(ref, account)
    for call in (services.confirmations.resolve(resolve), services.ledger.accept(accept)):
        refusal = await refusal_of(call)
        assert refusal is not None and refusal.code is ErrorCode.confirmation_expired


def test_the_script_checks_every_rule_in_order():
    script = binding.lua_checks()
    positions = [script.index(f"{{'refused', '{rule.reason.value}'") for rule in binding.RULES]
    assert positions == sorted(positions)


async def test_another_actions_confirmation_is_named_so_and_consumes_nothing(services):
    """A train confirmation given to a cancel, used or not, is the wrong action (not `consumed ...
    confirm again`), from both services alike; refused, it consumes nothing: a cancel one refused
    for a train is still good for its cancel, once."""
    account = "a" + uuid.uuid4().hex[:6]
    ref = await issue(services, account)
    _, accept = requests(ref, account)
    await services.ledger.accept(accept)  # the train consumed it
    as_cancel = {"action": Action.cancel, "target": "run_1", "manifest_digest": None, "cost_usd": None}
    resolve, cancel = requests(ref, account, **as_cancel)
    refusals = [
        await refusal_of(services.confirmations.resolve(resolve)),
        await refusal_of(services.ledger.accept(cancel)),
    ]
    for refusal in refusals:
        assert refusal is not None and refusal.code is ErrorCode.confirmation_action_mismatch
        assert refusal.message == (
            "this confirmation is for action train, not cancel: get one for cancel with "
            "`ecc ito confirm --action cancel --run run_1`"
        )

    cancel_ref = await issue(
        services, account, action=Action.cancel, target="run_1", manifest_digest=None, max_cost_usd=None
    )
    _, wrong = requests(cancel_ref, account)  # a train with the cancel confirmation
    refused = await refusal_of(services.ledger.accept(wrong))
    assert refused is not None and refused.code is ErrorCode.confirmation_action_mismatch
    assert (
        "get one for train with `ecc ito confirm --action train --booking b1 --manifest MANIFEST`"
        in refused.message
    )
    stored = await services.records.get(account, cancel_ref)
    assert stored is not None and stored.consumed is False
    _, right = requests(cancel_ref, account, **as_cancel)
    _, note = await services.ledger.accept(right)
    assert note is None  # accepted, the first time
    again = await refusal_of(
        services.ledger.accept(msgspec.structs.replace(right, idempotency_key="k-other"))
    )
    assert again is not None and again.code is ErrorCode.confirmation_consumed
