"""Redis persistence as documented: AOF with fsync on every write. A SIGKILLed Redis restarted from
its directory still holds every consumed confirmation and every idempotency reservation."""

import dataclasses
import os
import signal
import time
from datetime import UTC, datetime

import pytest

from contracts.api import Action
from contracts.errors import ErrorCode
from contracts.internal import LedgerAccept, LedgerEntry
from devstack import authority, infra
from domain.binding import Stored
from runtime.configuration import settings as settings_mod
from runtime.configuration.keys import Keys
from runtime.messaging import connections
from runtime.messaging.codec import Refusal
from services.confirmation.store import ConfirmationStore, new_ref
from services.ledger.store import LedgerStore


def start(tmp_path, port=None):
    s = settings_mod.load({"ITO_NAMESPACE": "durable", "ITO_DATA_DIR": str(tmp_path)})
    return authority.start_redis(s, tmp_path, port=port), s


def clients(server, s):
    """Each store through its own service's ACL user, as in production."""
    s = dataclasses.replace(s, redis_url=server.url)
    return connections.make_redis(s, "confirmation"), connections.make_redis(s, "ledger")


async def test_consumed_confirmation_and_reservation_survive_a_redis_kill(tmp_path):
    server, s = start(tmp_path)
    port = int(server.url.rsplit(":", 1)[1].split("/")[0])
    keys = Keys(s)
    try:
        rc, rl = clients(server, s)
        confirmations, ledger = ConfirmationStore(rc, keys), LedgerStore(rl, keys, retention_s=3600)
        ref = new_ref()
        await confirmations.create(
            ref,
            Stored(
                account="acme",
                action=Action.train,
                target="b1",
                digest="d" * 64,
                max_cost=1.0,
                expires_at=await confirmations.now() + 600,
                consumed=False,
            ),
        )
        req = LedgerAccept(
            account="acme",
            idempotency_key="k1",
            fingerprint="f",
            run_id="run_1",
            action=Action.train,
            confirmation_ref=ref,
            target="b1",
            manifest_digest="d" * 64,
            cost_usd=0.5,
        )
        entry = LedgerEntry(
            account="acme",
            idempotency_key="k1",
            fingerprint="f",
            run_id="run_1",
            action=Action.train,
            handed_off=False,
            created_at=datetime.now(UTC),
        )
        _, created = await ledger.accept(req, entry)
        assert created
        await rc.aclose()
        await rl.aclose()

        os.kill(server.pid, signal.SIGKILL)  # no shutdown save: only the AOF can bring state back
        time.sleep(0.2)
        server, s = start(tmp_path, port=port)
        rc, rl = clients(server, s)
        confirmations, ledger = ConfirmationStore(rc, keys), LedgerStore(rl, keys, retention_s=3600)
        assert (await confirmations.get("acme", ref)).consumed is True
        assert (await ledger.lookup("acme", "k1")).run_id == "run_1"
        fresh = LedgerAccept(
            **{
                **{f: getattr(req, f) for f in req.__struct_fields__},
                "idempotency_key": "k2",
                "run_id": "run_2",
            }
        )
        with pytest.raises(Refusal) as refused:
            await ledger.accept(fresh, entry)
        assert refused.value.code is ErrorCode.confirmation_consumed
        await rc.aclose()
        await rl.aclose()
    finally:
        infra.stop_pid(server.pid)
