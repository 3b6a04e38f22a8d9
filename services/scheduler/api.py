"""The canonical API's verbs that price and create a run: `plan`, `confirm` and `train`, gated in a
fixed order that fails closed. (The tenant's reads: of its account, services/scheduler/
account_reads.py; of its runs, run_reads.py and listing.py; its run mutations, mutations.py.)

Plan, and confirm of a train: rate -> manifest -> manifest inputs (the run's stages planned once,
there) -> eligibility -> the plan on those stages, refused at its first failed check.

Train: authenticate -> key format -> manifest (digest, parse, secrets) -> manifest inputs (the base
model in the model store, the tokenizer, the data files' digests and columns; the run's plan) ->
eligibility (signed, fresh) -> plan and gate-5 checks -> a confirmation reference given ->
eligibility still fresh (of the same booking version) -> ledger accept (one atomic script: the
key's existing run answers a replay; else the confirmation's binding is checked, the confirmation
consumed and the key reserved) -> hand-off to the trainer. A request refused by a gate is answered
with its key's run when the key already has one (a replay answers whatever changed since). Nothing
is written before the accept; every gate's decision goes to the audit stream, as one record per
request.
"""

import asyncio
import logging
import pathlib
import secrets
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import msgspec

from contracts.api import (
    Action,
    ConfirmationIssued,
    ConfirmRequest,
    PlanRequest,
    RunAccepted,
    TrainRequest,
    accepted,
)
from contracts.errors import ErrorCode
from contracts.internal import ConfirmationCreate, EligibilityBody, LedgerAccept, LedgerEntry
from contracts.manifest import Manifest
from contracts.plans import Plan
from contracts.runs import TrainWork
from contracts.states import CANCELLABLE
from domain import binding, budget
from domain import quotas as quota_rules
from domain.curriculum import curriculum_digest
from domain.quotas import Taken
from runtime.configuration import faults
from runtime.messaging.codec import Refusal
from runtime.storage.checkpoint_paths import run_dir
from runtime.storage.model_store import ModelStore
from runtime.tenancy.accounts import Credentials
from runtime.tenancy.quota_stores import InMemoryQuotas, Quotas, breach_refusal
from runtime.tenancy.quota_stores import refusal as rate_refusal
from services.scheduler import planning
from services.scheduler.admission import MAX_IDEMPOTENCY_KEY as MAX_IDEMPOTENCY_KEY  # re-exported
from services.scheduler.admission import authenticate, fingerprint, key_conflict, key_refusal
from services.scheduler.admission import valid_idempotency_key as valid_idempotency_key  # re-exported
from services.scheduler.audit import Auditor, Trail
from services.scheduler.data_facts import DataFacts
from services.scheduler.file_records import FileRecords
from services.scheduler.handoff import Handoff
from services.scheduler.inputs import ManifestInputs, Runnable
from services.scheduler.manifests import parsed_off_loop
from services.scheduler.peers import Peers
from services.scheduler.prices import PriceTable
from services.scheduler.store import RunRecords

log = logging.getLogger("ito.scheduler.api")


def _raised(outcome: Any) -> Any:
    """A value `asyncio.gather(..., return_exceptions=True)` gave: raised when it is an exception."""
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


CONFIRMATION_REFUSALS = frozenset(binding.CODES.values())
"""The codes of a confirmation's binding: the confirmation gate's."""


def plan_refusal_message(p: Plan) -> str:
    return "; ".join(f"{c.name}: {c.reason}" for c in p.checks if not c.ok)


def refuse_failed(p: Plan) -> None:
    """The plan's first failed check as the request's refusal (every failed check in its message)."""
    first = planning.first_refusal(p)
    if first is not None:
        raise Refusal(first[0], plan_refusal_message(p))


class Api:
    def __init__(
        self,
        credentials: Credentials,
        peers: Peers,
        runs: RunRecords,
        handoff: Handoff,
        auditor: Auditor,
        prices: PriceTable,
        checkpoint_root: pathlib.Path,
        *,
        small_model_gangs: bool = False,
        count_accepted: Callable[[], None] = lambda: None,
        model_store: ModelStore | None = None,
        quotas: Quotas | None = None,
        files: FileRecords | None = None,
        data_facts: DataFacts | None = None,
        file_root: str | None = None,
        storage_roots: tuple[pathlib.Path, ...] = (),
    ) -> None:
        self.auditor = auditor
        self.count_accepted = count_accepted  # `ito_runs_accepted_total` (runtime/messaging/metrics.py)
        self.small_model_gangs = small_model_gangs  # settings.Settings.small_model_gangs
        self.credentials = credentials
        self.peers = peers
        self.runs = runs
        self.handoff = handoff
        self.prices = prices
        self.checkpoint_root = checkpoint_root
        # model_store None: no base model resolves (every one is model_not_found)
        self.inputs = ManifestInputs(model_store, files, data_facts, file_root)
        self.storage_roots = storage_roots  # ITO_CHECKPOINT_ROOTS: what checkpoint.storage may name
        self.quotas = quotas if quotas is not None else InMemoryQuotas()  # RedisQuotas in the service

    async def _rated(self, caller: str, req, open_runs: bool = False) -> tuple[str, Taken]:
        """The account, once its request-rate bucket admitted this request (plan, confirm, train):
        the first gate, which writes no audit record (the NATS server authenticated the caller's
        account already: only its credential may publish on its subject). A refusal this instance
        remembers is answered first, with no Redis read at all (a flood's); otherwise the bucket's take and the key records' read go side by side (one round trip's
        wait, not two), and the rate's refusal still comes first."""
        remembered = self.quotas.remembered(caller)
        if remembered is not None:
            raise rate_refusal(remembered) or Refusal(ErrorCode.rate_limited, "over the request rate")
        carried = len((getattr(req, "manifest_text", None) or "").encode())  # plan, confirm, train
        took, info = await asyncio.gather(
            self.quotas.take(caller, cost=quota_rules.request_cost(carried), open_runs=open_runs),
            authenticate(self.credentials, caller, req),
            return_exceptions=True,
        )
        taken: Taken = _raised(took)
        refusal = rate_refusal(taken)
        if refusal is not None:
            raise refusal
        return _raised(info).account, taken

    async def _run_quota(self, account: str, taken: Taken) -> Refusal | None:
        """`quota_exceeded` when one more run would go over the account's `runs` or `queued`; the
        open runs' states are read only when their count could reach a limit. The limits and the
        count come with the request's rate take (one script) where the quotas can give them."""
        open_at_most = taken.open_at_most
        if open_at_most is None:
            open_at_most = await self.runs.open_at_most(account)
        if taken.runs and taken.queued and not quota_rules.may_breach(taken, open_at_most):
            return None
        limits = await self.quotas.limits(account)
        return breach_refusal(quota_rules.run_breach(limits, await self.runs.open_states(account)))

    async def _run_quota_boxed(self, account: str, taken: Taken) -> tuple[Refusal | None]:
        """`_run_quota` in a tuple: beside other reads, its refusal (a value) is not an error."""
        return (await self._run_quota(account, taken),)

    def _plan_on(self, manifest: Manifest, digest: str, body: EligibilityBody, runnable: Runnable) -> Plan:
        return planning.plan(
            manifest,
            digest,
            body,
            self.prices,
            small_model_gangs=self.small_model_gangs,
            base=runnable.base,
            now=datetime.now(UTC),  # the booking's remaining window is measured from now
            run=runnable.curriculum,  # the stages the manifest-inputs gate planned: planned once per request
            storage_roots=self.storage_roots,
        )

    async def _planned_request(
        self, account: str, booking_id: str, text: str, client_digest: str
    ) -> tuple[Manifest, str, Plan]:
        """`plan`'s and `confirm --action train`'s gates: the manifest's bytes (remembered by digest),
        its inputs every time (services/scheduler/inputs.py: store reads in worker threads, data checks
        in child processes: nothing stalls every other request on the event loop), the signed
        eligibility, and the plan on them, refused at its first failed check."""
        manifest, digest = await parsed_off_loop(text, client_digest)
        runnable = await self.inputs.runnable(manifest, account)
        body = await self.peers.verified_eligibility(account, booking_id, manifest)
        p = self._plan_on(manifest, digest, body, runnable)
        refuse_failed(p)
        return manifest, digest, p

    async def plan(self, caller: str, req: PlanRequest) -> Plan:
        """Creates nothing: no run, no confirmation, no ledger entry, nothing on the queue."""
        account, _ = await self._rated(caller, req)
        _, _, p = await self._planned_request(account, req.booking_id, req.manifest_text, req.manifest_digest)
        return p

    async def confirm(self, caller: str, req: ConfirmRequest) -> ConfirmationIssued:
        """A single-use capability bound to account, action, target, digest and cost. Only the
        opaque reference leaves the server; it authorizes nothing by itself."""
        account, _ = await self._rated(caller, req)
        if req.action is Action.train:
            return await self._confirm_train(account, req)
        if req.action is Action.delete_file:
            if req.file_id is None:
                raise Refusal(ErrorCode.request_invalid, "confirm --action delete_file needs --file")
            files = self.inputs.files
            if files is None or await files.file(account, req.file_id) is None:
                raise Refusal(ErrorCode.data_not_found, f"no file {req.file_id!r} for this account")
            target = req.file_id
        elif req.action is Action.release_booking:
            if req.booking_id is None:
                raise Refusal(ErrorCode.request_invalid, "confirm --action release_booking needs --booking")
            owned = {b.booking_id for b in (await self.peers.bookings(account)).bookings}
            if req.booking_id not in owned:
                raise Refusal(ErrorCode.booking_not_found, "no such booking for this account")
            target = req.booking_id
        else:  # cancel, cleanup, restart_from_checkpoint: bound to one of the caller's runs
            if req.run_id is None:
                raise Refusal(ErrorCode.request_invalid, f"confirm --action {req.action.value} needs --run")
            view = await self.runs.get(account, req.run_id)
            if view is None:
                raise Refusal(ErrorCode.run_not_found, "no such run for this account")
            if req.action is Action.cancel and view.state not in CANCELLABLE:  # before a person confirms
                raise Refusal(
                    ErrorCode.run_not_cancellable,
                    f"the run is {view.state.value}: it cannot be cancelled, so there is nothing to confirm",
                )
            target = req.run_id
        return await self.peers.create_confirmation(
            ConfirmationCreate(
                account=account,
                action=req.action,
                target=target,
                manifest_digest=None,
                max_cost_usd=None,
            )
        )

    async def _confirm_train(self, account: str, req: ConfirmRequest) -> ConfirmationIssued:
        if req.booking_id is None or req.manifest_text is None or req.manifest_digest is None:
            raise Refusal(ErrorCode.request_invalid, "confirm --action train needs --booking and --manifest")
        manifest, digest, p = await self._planned_request(
            account, req.booking_id, req.manifest_text, req.manifest_digest
        )
        # The bound the person authorises: what they said, else what the manifest and booking allow
        # (the run's spend limit); the run is stopped before its spend crosses it.
        default = budget.manifest_limit(manifest, p.cost)
        max_cost = req.max_cost_usd if req.max_cost_usd is not None else default
        if p.cost.total_usd > max_cost:
            raise Refusal(
                ErrorCode.budget_exceeded,
                f"the estimate {p.cost.total_usd:.2f} USD is above --max-cost {max_cost:.2f} USD",
            )
        return await self.peers.create_confirmation(
            ConfirmationCreate(
                account=account,
                action=Action.train,
                target=req.booking_id,
                manifest_digest=digest,
                max_cost_usd=max_cost,
            )
        )

    async def _refreshed(
        self, account: str, booking_id: str, manifest: Manifest, planned_on: EligibilityBody
    ) -> EligibilityBody:
        body = await self.peers.verified_eligibility(account, booking_id, manifest)
        if body.booking_version != planned_on.booking_version:
            raise Refusal(
                ErrorCode.eligibility_stale,
                f"the booking changed (version {planned_on.booking_version} -> {body.booking_version}) "
                "while the request was checked; plan and confirm again",
            )
        return body

    async def _replay(self, entry: LedgerEntry, fp: str) -> tuple[RunAccepted, str]:
        if entry.fingerprint != fp:
            raise key_conflict()
        view = await self.runs.get(entry.account, entry.run_id)
        view = view if view is not None else self.handoff.view_from(entry)
        return accepted(view, replay=True), "replay: this idempotency key already created this run"

    async def train(self, caller: str, req: TrainRequest) -> tuple[RunAccepted, str | None]:
        account, taken = await self._rated(caller, req, open_runs=True)
        trail = Trail("run_" + secrets.token_hex(12), account, Action.train, req.booking_id)
        try:
            return await self._train(req, account, taken, trail)
        finally:
            await self.auditor.publish(trail)

    async def _train(
        self, req: TrainRequest, account: str, taken: Taken, trail: Trail
    ) -> tuple[RunAccepted, str | None]:
        """The gates in their fixed order; each step below records its own decisions. A replay
        is answered by the ledger: its accept script looks the key up before anything else, and
        a request refused by a gate is answered with its key's run when the key has one."""
        trail.record("authenticate", True)
        trail.check("idempotency_key_format", key_refusal(req.idempotency_key))
        manifest, digest = await self._manifest(req, trail)
        fp = fingerprint(Action.train, account, req.booking_id, digest)
        try:
            return await self._create(req, account, manifest, digest, fp, taken, trail)
        except Refusal:
            existing = await self._existing(account, req.idempotency_key, trail)
            if existing is None:
                raise
            return await trail.gate("replay", self._replay(existing, fp))

    async def _create(
        self,
        req: TrainRequest,
        account: str,
        manifest: Manifest,
        digest: str,
        fp: str,
        taken: Taken,
        trail: Trail,
    ) -> tuple[RunAccepted, str | None]:
        # Three reads that do not depend on each other, side by side (issue 30: one after another
        # they were a third of the request's wait): the run quota; the manifest's inputs (the store
        # and the files may have changed since the bytes were checked: every time); the signed
        # eligibility. Their gates are judged and recorded in the fixed order all the same, and
        # nothing is reserved before all three passed. A replay of a key that has its run is
        # answered anyway.
        quota, inputs, eligibility = await asyncio.gather(
            self._run_quota_boxed(account, taken),
            self.inputs.runnable(manifest, account),
            self.peers.verified_eligibility(account, req.booking_id, manifest),
            return_exceptions=True,
        )
        trail.check("quota", _raised(quota)[0])
        if isinstance(inputs, Refusal):
            trail.refuse("manifest_inputs", inputs)
        runnable: Runnable = _raised(inputs)
        trail.record("manifest_inputs", True)
        if isinstance(eligibility, Refusal):
            trail.refuse("eligibility", eligibility)
        body = _raised(eligibility)
        trail.record("eligibility", True)
        p = self._planned(manifest, digest, body, runnable, trail)
        if not req.confirmation_ref:
            trail.refuse(
                "confirmation",
                Refusal(
                    ErrorCode.confirmation_required,
                    "run `ecc ito confirm --action train` first and pass --confirmation-ref",
                ),
            )
        if not self.peers.still_fresh(body, datetime.now(UTC)):
            # Re-fetched, never stretched: the gate is checked again at the moment of creation,
            # and the plan holds only for the booking version it was made on.
            await trail.gate("eligibility_refresh", self._refreshed(account, req.booking_id, manifest, body))
        work = self._work(trail.request_id, account, req, manifest, digest, p, runnable)
        entry = await self._accepted(account, req, fp, work, trail)
        if entry.run_id != work.run_id:  # the key already has a run (or a concurrent request won it)
            return await trail.gate("replay", self._replay(entry, fp))
        faults.crash_here(faults.SCHEDULER_AFTER_ACCEPT)
        view = await trail.gate("hand_off", self.handoff.hand_off(entry, wait_for_mark=False))
        self.count_accepted()
        log.info("run %s accepted for account %s on booking %s", work.run_id, account, req.booking_id)
        return accepted(view), None

    async def _existing(self, account: str, key: str, trail: Trail) -> LedgerEntry | None:
        """The entry of a key whose request a gate refused (a replay answers with its run); None
        when the key has none, or when the ledger cannot say (the refusal then stands)."""
        try:
            return await trail.gate("ledger_lookup", self.peers.ledger_lookup(account, key))
        except Refusal:
            return None

    async def _accepted(
        self, account: str, req: TrainRequest, fp: str, work: TrainWork, trail: Trail
    ) -> LedgerEntry:
        """The ledger's one atomic step: look the key up, check the confirmation's binding,
        consume it and reserve the key. Its decisions are recorded as the gates they are."""
        try:
            entry = await self._reserve(account, req, fp, work)
        except Refusal as refusal:
            if refusal.code in CONFIRMATION_REFUSALS:
                trail.refuse("confirmation", await self._precise(account, req, work, refusal))
            trail.refuse("ledger_accept", refusal)
        if entry.run_id == work.run_id:
            trail.record("ledger_lookup", True)  # the key had no run: the script looked first
            trail.record("confirmation", True)
        trail.record("ledger_accept", True)
        return entry

    async def _precise(self, account: str, req: TrainRequest, work: TrainWork, refusal: Refusal) -> Refusal:
        """An unknown reference may be another account's: the confirmation service can tell
        (its owner index); any other binding refusal is already precise."""
        if refusal.code is not ErrorCode.confirmation_not_found or not req.confirmation_ref:
            return refusal
        try:
            await self.peers.resolve_confirmation(
                account,
                req.confirmation_ref,
                Action.train,
                req.booking_id,
                work.manifest_digest,
                work.plan.cost.total_usd,
            )
        except Refusal as precise:
            return precise if precise.code in CONFIRMATION_REFUSALS else refusal
        return refusal

    @staticmethod
    async def _manifest(req: TrainRequest, trail: Trail) -> tuple[Manifest, str]:
        try:
            manifest, digest = await parsed_off_loop(req.manifest_text, req.manifest_digest)
        except Refusal as refusal:
            trail.refuse("manifest", refusal)
        trail.digest = digest
        trail.record("manifest", True)
        return manifest, digest

    def _planned(
        self, manifest: Manifest, digest: str, body: EligibilityBody, runnable: Runnable, trail: Trail
    ) -> Plan:
        p = self._plan_on(manifest, digest, body, runnable)
        for check in p.checks:
            trail.record(f"plan.{check.name}", check.ok, check.code)
        refuse_failed(p)
        return p

    def _work(
        self,
        run_id: str,
        account: str,
        req: TrainRequest,
        manifest: Manifest,
        digest: str,
        p: Plan,
        runnable: Runnable,
    ) -> TrainWork:
        return TrainWork(
            run_id=run_id,
            account=account,
            booking_id=req.booking_id,
            manifest_text=req.manifest_text,
            manifest_digest=digest,
            plan=p,
            checkpoint_dir=str(run_dir(self.checkpoint_root, manifest.checkpoint.storage, account, run_id)),
            nodes=manifest.resources.nodes,
            rendezvous=self.handoff.rendezvous(manifest.resources.nodes),
            rendezvous_key=self.handoff.rendezvous_key(manifest.resources.nodes),
            base=runnable.base,  # resolved once, here: the trainer reads the weights by this digest
            # the estimate; the ledger's accept records the consumed confirmation's bound and the
            # hand-off writes that one in (services/scheduler/handoff.py `bounded`)
            cost_bound_usd=p.cost.total_usd,
            curriculum_digest=curriculum_digest(runnable.curriculum),  # what `p` priced: this or nothing
            inputs=runnable.inputs,  # the tenant's data as resolved and checked: read by locator, by digest
        )

    async def _reserve(self, account: str, req: TrainRequest, fp: str, work: TrainWork) -> LedgerEntry:
        """Consume the confirmation and reserve the key, one atomic step in the ledger."""
        return await self.peers.ledger_accept(
            LedgerAccept(
                account=account,
                idempotency_key=req.idempotency_key,
                fingerprint=fp,
                run_id=work.run_id,
                action=Action.train,
                confirmation_ref=req.confirmation_ref or "",
                target=req.booking_id,
                manifest_digest=work.manifest_digest,
                cost_usd=work.plan.cost.total_usd,
                work=msgspec.json.encode(work),
            )
        )
