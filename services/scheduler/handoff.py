"""Hand an accepted run to the trainer's work queue, exactly once, and finish lost hand-offs.

The ledger entry carries the encoded work item, so the request path and the reconciler share this
one code path: create the run view `queued` (idempotent: never over a view that moved on),
publish with Nats-Msg-Id = run id (JetStream drops a duplicate inside its window), and tell the
ledger. If the
scheduler dies anywhere in between, the reconciler finds the key still pending and repeats the
steps; each is idempotent, so no run is lost and none is duplicated.

A run on several nodes is one work item per node (`node_shares`): node 0's is the ledger's item
itself; node n's is the same item with `node_rank = n`, published with Nats-Msg-Id
`<run id>:node-<n>`. Each is signed like any work item, so the node rank cannot be forged. The
booking's topology (the manifest's `resources.nodes`) decides how many; the scheduler picks the
rendezvous endpoint (`rendezvous`) that node 0 hosts and the others join.
"""

import asyncio
import logging
import secrets
import socket
from collections.abc import Coroutine
from typing import Any

import msgspec

from contracts.api import RunView, Spend
from contracts.internal import LedgerEntry
from contracts.manifest import Manifest
from contracts.runs import RunCreated, TrainWork
from contracts.states import RunState
from domain import budget
from runtime.configuration.settings import Settings
from runtime.messaging.bus import Bus
from services.scheduler.peers import Peers
from services.scheduler.publish import RunEventPublisher
from services.scheduler.store import RunRecords

log = logging.getLogger("ito.scheduler.handoff")

RECONCILE_EVERY_S = 5.0
RECONCILE_AFTER_S = 5.0  # leave a live request time to finish its own hand-off

_work_decoder = msgspec.json.Decoder(TrainWork)
_manifest_decoder = msgspec.json.Decoder(Manifest)


def nothing_spent(work: TrainWork, at: Any) -> Spend | None:
    """A new run's spend: none yet, against the limit its manifest and plan set (None, and so no
    budget stop, for an item whose manifest does not decode: the trainer refuses that one anyway)."""
    try:
        manifest = _manifest_decoder.decode(work.manifest_text)
    except msgspec.MsgspecError:
        log.warning("run %s: the work item's manifest does not decode; spend not bounded", work.run_id)
        return None
    limit = budget.spend_limit(manifest, work.plan.cost, work.cost_bound_usd)
    return Spend(held_gpus=work.plan.cost.gpus, held_gpu_s=0.0, spent_usd=0.0, limit_usd=limit, at=at)


def bounded_item(entry: LedgerEntry) -> tuple[TrainWork, bool]:
    """The entry's work item carrying the cost bound the ledger recorded from the consumed
    confirmation (what the person authorised the run to spend) in place of the scheduler's
    estimate, and whether that changed it; the estimate stays when it recorded none (never more
    than authorised). One decode."""
    work = _work_decoder.decode(entry.work)
    if entry.cost_bound_usd is None or work.cost_bound_usd == entry.cost_bound_usd:
        return work, False
    return msgspec.structs.replace(work, cost_bound_usd=entry.cost_bound_usd), True


def bounded(entry: LedgerEntry) -> LedgerEntry:
    """The entry with `bounded_item` as its encoded work item (unchanged when nothing changes)."""
    if entry.cost_bound_usd is None or not entry.work:
        return entry
    work, changed = bounded_item(entry)
    return msgspec.structs.replace(entry, work=msgspec.json.encode(work)) if changed else entry


def node_shares(work: TrainWork, msg_id: str | None = None) -> list[tuple[TrainWork, str]]:
    """A run's work items, one per node, with their Nats-Msg-Ids: node 0's is `msg_id` (by default
    the run id, as for every single-node run, so a one-node run is handed off exactly as before),
    node n's `<msg_id>:node-<n>`. An approved restart passes its own id so that every node restarts."""
    base = msg_id or work.run_id
    shares = [(work, base)]
    for n in range(1, work.nodes):
        shares.append((msgspec.structs.replace(work, node_rank=n), f"{base}:node-{n}"))
    return shares


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Handoff:
    def __init__(self, bus: Bus, settings: Settings, runs: RunRecords, peers: Peers) -> None:
        self.settings = settings
        self.runs = runs
        self.peers = peers
        self.events = RunEventPublisher(bus, settings)
        self._marks: set[asyncio.Task] = set()

    def _in_background(self, mark: Coroutine[Any, Any, object], run_id: str) -> None:
        async def marked() -> None:
            try:
                await mark  # bounded: a backend call has the request timeout
            except Exception:
                log.warning("run %s: the hand-off mark did not land; the reconciler repeats it", run_id)

        task = asyncio.create_task(marked())
        self._marks.add(task)  # a reference until it ends, so that it is not collected mid-flight
        task.add_done_callback(self._marks.discard)

    def rendezvous(self, nodes: int) -> str:
        """Where node 0 of a multi-node run hosts its rendezvous store ("" for one node): the
        settings' host and a port free there now (on one machine, the agents' loopback)."""
        if nodes <= 1:
            return ""
        host = self.settings.rendezvous_host
        return f"{host}:{free_port(host)}"

    @staticmethod
    def rendezvous_key(nodes: int) -> str:
        """The run's rendezvous key ("" for one node): 32 random bytes, only inside the work item."""
        return secrets.token_urlsafe(32) if nodes > 1 else ""

    def view_from(self, entry: LedgerEntry) -> RunView:
        work, _ = bounded_item(entry)  # one decode, the bound applied
        return RunView(
            run_id=work.run_id,
            account=work.account,
            booking_id=work.booking_id,
            manifest_digest=work.manifest_digest,
            idempotency_key=entry.idempotency_key,
            state=RunState.accepted,
            created_at=entry.created_at,
            updated_at=entry.created_at,
            plan=work.plan,
            checkpoint_dir=work.checkpoint_dir,
            nodes=work.nodes,
            spend=nothing_spent(work, entry.created_at),
        )

    async def hand_off(self, entry: LedgerEntry, wait_for_mark: bool = True) -> RunView:
        """The view is created `queued`: its work item reaches the queue now, or through the
        reconciler if this process dies first (the ledger keeps the key pending until the mark
        below). Steps that do not depend on each other run side by side: the view and the run's
        creation event; then the work items (after both: the trainer leases against the view,
        and the run's history starts with its creation); then the ledger's hand-off mark, which
        the request path does not wait for (`wait_for_mark=False`): the mark only tells the
        reconciler there is nothing left to do, and a mark that never lands has it repeat these
        steps, each idempotent (the work item's id dedups it in the stream)."""
        entry = bounded(entry)  # the item handed off, kept and restarted carries the authorised bound
        view = msgspec.structs.replace(self.view_from(entry), state=RunState.queued)
        plan = view.plan
        created = RunCreated(
            **self.events.base(view.run_id),
            account=view.account,
            booking_id=view.booking_id,
            region=plan.region if plan else "",
            gpu_model=plan.gpu_model if plan else "",
            gpus=plan.cost.gpus if plan else 1,
            accepted_at=view.created_at,
            booked_gpus=plan.capacity.booked_gpus if plan and plan.capacity else 0,
            booked_gpu_hours=plan.cost.booked_gpu_hours if plan else 0.0,
        )
        fresh, _ = await asyncio.gather(
            self.runs.create(view, work=entry.work),  # the item kept for an approved restart
            self.events.publish(created, f"{view.run_id}:created"),
        )
        await self.peers.publish_work(entry.run_id, entry.work, entry.run_id)
        for share, msg_id in node_shares(_work_decoder.decode(entry.work))[1:]:
            await self.peers.publish_work(entry.run_id, msgspec.json.encode(share), msg_id)
        mark = self.peers.ledger_handed_off(entry.account, entry.idempotency_key)
        if wait_for_mark:
            await mark
        else:
            self._in_background(mark, entry.run_id)
        if fresh:
            return view
        return await self.runs.get(entry.account, entry.run_id) or view  # a reconciled one moved on

    async def reconcile_once(self) -> int:
        """Finish the hand-offs the ledger still holds as pending after RECONCILE_AFTER_S."""
        done = 0
        for entry in await self.peers.ledger_pending(RECONCILE_AFTER_S):
            log.warning("reconciler: finishing the hand-off of run %s", entry.run_id)
            await self.hand_off(entry)
            done += 1
        return done

    async def reconcile_forever(self) -> None:
        while True:
            await asyncio.sleep(RECONCILE_EVERY_S)
            try:
                await self.reconcile_once()
            except Exception:  # the loop must survive an outage; it retries on the next tick
                log.exception("reconciler pass failed; retrying in %.0fs", RECONCILE_EVERY_S)
