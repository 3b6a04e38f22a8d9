"""Cancel and cleanup: separate, confirmed, idempotent mutations of a run, and the trainer's lease.

Each mutation follows train's order: authenticate -> key format -> the run (tenant-scoped) ->
ledger lookup (a replay answers here) -> state check -> confirmation resolve -> ledger accept
(consumes the confirmation and reserves the key atomically) -> effect.
"""

import logging
import time
from datetime import UTC, datetime

import msgspec

from contracts.api import (
    Action,
    ApproveRequest,
    CancelRequest,
    CleanupOrder,
    CleanupRequest,
    CleanupResult,
    LeaseAnswer,
    LeaseQuery,
    MutationResult,
    RunView,
)
from contracts.errors import ErrorCode
from contracts.internal import LedgerAccept, LedgerEntry
from contracts.manifest import Manifest
from contracts.runs import TrainWork
from contracts.states import TERMINAL_STATES, RunState
from services.runtime import codec
from services.runtime.codec import Refusal
from services.scheduler import lifecycle, liveness
from services.scheduler.api import authenticate, fingerprint, valid_idempotency_key
from services.scheduler.backends import Backends
from services.scheduler.store import RunStore

log = logging.getLogger("ito.scheduler.mutations")

# A trainer may (keep) training a run in these states; anything else means stop or skip.
LEASABLE = frozenset({RunState.accepted, RunState.queued, RunState.running, RunState.interrupted})
# Cancel ends these at once: no trainer is working on them.
CANCEL_AT_ONCE = frozenset(
    {RunState.accepted, RunState.queued, RunState.interrupted, RunState.awaiting_approval}
)
_cleanup_decoder = msgspec.json.Decoder(CleanupResult)
_work_decoder = msgspec.json.Decoder(TrainWork)
_manifest_decoder = msgspec.json.Decoder(Manifest)


def target_ids(view: RunView, key: str) -> dict:
    """The identifiers every mutation answer carries: its target run's and its own key."""
    return {"booking_id": view.booking_id, "manifest_digest": view.manifest_digest, "idempotency_key": key}


def binding_matches(view: RunView, req: LeaseQuery) -> bool:
    return (req.account, req.booking_id, req.manifest_digest, req.plan_sha256) == (
        view.account,
        view.booking_id,
        view.manifest_digest,
        codec.digest(view.plan),
    )


class Mutations:
    def __init__(self, r, keys, backends: Backends, runs: RunStore) -> None:
        self.r = r
        self.keys = keys
        self.backends = backends
        self.runs = runs

    async def _run(self, caller: str, req, run_id: str, key: str) -> tuple[str, RunView]:
        account = (await authenticate(self.r, self.keys, caller, req)).account
        if not valid_idempotency_key(key):
            raise Refusal(
                ErrorCode.idempotency_key_invalid, "idempotency keys are 1-255 printable ASCII characters"
            )
        view = await self.runs.get(account, run_id)
        if view is None:
            raise Refusal(ErrorCode.run_not_found, "no such run for this account")
        return account, view

    async def _accept(
        self, account: str, key: str, action: Action, target: str, ref: str | None
    ) -> LedgerEntry:
        if not ref:
            raise Refusal(
                ErrorCode.confirmation_required,
                f"run `ecc ito confirm --action {action.value}` first and pass its reference",
            )
        await self.backends.resolve_confirmation(account, ref, action, target, None, None)
        return await self.backends.ledger_accept(
            LedgerAccept(
                account=account,
                idempotency_key=key,
                fingerprint=fingerprint(action, account, target, ""),
                run_id=target,
                action=action,
                confirmation_ref=ref,
                target=target,
            )
        )

    async def _existing(self, account: str, key: str, action: Action, target: str) -> LedgerEntry | None:
        entry = await self.backends.ledger_lookup(account, key)
        if entry is not None and entry.fingerprint != fingerprint(action, account, target, ""):
            raise Refusal(
                ErrorCode.idempotency_key_conflict, "this idempotency key was used for another request"
            )
        return entry

    async def cancel(self, caller: str, req: CancelRequest) -> tuple[MutationResult, str | None]:
        account, view = await self._run(caller, req, req.run_id, req.idempotency_key)
        if await self._existing(account, req.idempotency_key, Action.cancel, req.run_id) is not None:
            return (
                MutationResult(
                    run_id=req.run_id,
                    action=Action.cancel,
                    state=view.state,
                    replay=True,
                    **target_ids(view, req.idempotency_key),
                ),
                "replay: this idempotency key already cancelled this run",
            )
        if view.state in TERMINAL_STATES or view.state is RunState.cancelling:
            raise Refusal(ErrorCode.run_not_cancellable, f"the run is {view.state.value}")
        entry = await self._accept(
            account, req.idempotency_key, Action.cancel, req.run_id, req.confirmation_ref
        )
        if entry.fingerprint != fingerprint(Action.cancel, account, req.run_id, ""):
            raise Refusal(
                ErrorCode.idempotency_key_conflict, "this idempotency key was used for another request"
            )

        def to_cancelled(v: RunView) -> RunView:
            if v.state in TERMINAL_STATES or v.state is RunState.cancelling:
                return v
            target = RunState.cancelled if v.state in CANCEL_AT_ONCE else RunState.cancelling
            return lifecycle.transition(v, target, datetime.now(UTC), message="cancelled by the account")

        updated, _ = await self.runs.update(account, req.run_id, None, to_cancelled)
        await self.backends.notify_cancel(req.run_id)
        log.info("run %s: cancel accepted (%s)", req.run_id, updated.state.value)
        return MutationResult(
            run_id=req.run_id,
            action=Action.cancel,
            state=updated.state,
            **target_ids(view, req.idempotency_key),
        ), None

    async def cleanup(self, caller: str, req: CleanupRequest) -> tuple[CleanupResult, str | None]:
        account, view = await self._run(caller, req, req.run_id, req.idempotency_key)
        if await self._existing(account, req.idempotency_key, Action.cleanup, req.run_id) is not None:
            stored = await self.runs.recall(account, req.run_id, "cleanup")
            result = (
                _cleanup_decoder.decode(stored) if stored else CleanupResult(run_id=req.run_id, removed=[])
            )
            return (
                msgspec.structs.replace(result, replay=True, **target_ids(view, req.idempotency_key)),
                "replay: this idempotency key already cleaned up this run",
            )
        if view.state not in TERMINAL_STATES:
            raise Refusal(
                ErrorCode.run_not_finished, f"the run is {view.state.value}; cancel it or let it finish first"
            )
        if req.release_booking and not req.release_confirmation_ref:
            raise Refusal(
                ErrorCode.confirmation_required,
                "--release-booking needs its own `release_booking` confirmation (--release-confirmation-ref)",
            )
        if req.release_booking:  # checked before anything is consumed, so a refusal changes nothing
            await self.backends.resolve_confirmation(
                account, req.release_confirmation_ref, Action.release_booking, view.booking_id, None, None
            )
        await self._accept(account, req.idempotency_key, Action.cleanup, req.run_id, req.confirmation_ref)
        work = await self.runs.recall(account, req.run_id, "work")
        storage = (
            _manifest_decoder.decode(_work_decoder.decode(work).manifest_text).checkpoint.storage
            if work
            else "local"
        )
        order = CleanupOrder(
            account=account, run_id=req.run_id, checkpoint_dir=view.checkpoint_dir or "", storage=storage
        )
        result = await self.backends.trainer_cleanup(order)
        await self.runs.forget_checkpoints(account, req.run_id)
        released = False
        if req.release_booking:
            await self.backends.ledger_accept(
                LedgerAccept(
                    account=account,
                    idempotency_key=f"{req.idempotency_key}#release_booking",
                    fingerprint=fingerprint(Action.release_booking, account, view.booking_id, ""),
                    run_id=req.run_id,
                    action=Action.release_booking,
                    confirmation_ref=req.release_confirmation_ref,
                    target=view.booking_id,
                )
            )
            await self.backends.request_release(account, view.booking_id, req.run_id)
            released = True
        result = msgspec.structs.replace(
            result, booking_release_requested=released, **target_ids(view, req.idempotency_key)
        )
        await self.runs.remember(account, req.run_id, "cleanup", msgspec.json.encode(result))
        await self.runs.update(
            account,
            req.run_id,
            None,
            lambda v: msgspec.structs.replace(v, cleaned_up=True, updated_at=datetime.now(UTC)),
        )
        return result, None

    async def approve(self, caller: str, req: ApproveRequest) -> tuple[MutationResult, str | None]:
        """A paused run's restart proposal: approved only with a `restart_from_checkpoint`
        confirmation for this run; rejected, the run stays paused and says so. Never automatic."""
        account, view = await self._run(caller, req, req.run_id, req.idempotency_key)
        action = Action.restart_from_checkpoint
        existing = await self._existing(account, req.idempotency_key, action, req.run_id)
        if existing is None and (view.state is not RunState.awaiting_approval or view.proposal is None):
            raise Refusal(
                ErrorCode.proposal_not_found, f"the run is {view.state.value} with no proposal to decide"
            )
        if req.reject:
            message = (
                f"restart proposal rejected; the run stays paused at {view.proposal.stage} step "
                f"{view.proposal.spike_step}: cancel it, or confirm and approve a restart"
            )
            updated, _ = await self.runs.update(
                account,
                req.run_id,
                None,
                lambda v: msgspec.structs.replace(v, message=message, updated_at=datetime.now(UTC)),
            )
            return MutationResult(
                run_id=req.run_id, action=action, state=updated.state, **target_ids(view, req.idempotency_key)
            ), message
        if existing is None:
            await self._accept(account, req.idempotency_key, action, req.run_id, req.confirmation_ref)
        current = await self.runs.get(account, req.run_id)
        if current.state is RunState.awaiting_approval and current.proposal is not None:
            # (again on a replay, if the first attempt died before this point: publishing is idempotent)
            work = _work_decoder.decode(await self.runs.recall(account, req.run_id, "work"))
            restart = msgspec.structs.replace(work, restart=current.proposal)
            msg_id = (
                f"{req.run_id}:restart:{fingerprint(action, account, req.run_id, req.idempotency_key)[:16]}"
            )

            def to_queued(v: RunView) -> RunView:
                if v.state is not RunState.awaiting_approval:
                    return v
                moved = lifecycle.transition(
                    v,
                    RunState.queued,
                    datetime.now(UTC),
                    message=(
                        f"restart approved: from checkpoint step {v.proposal.checkpoint_step}, skipping batches "
                        f"[{v.proposal.skip_from}, {v.proposal.skip_to})"
                    ),
                )
                return msgspec.structs.replace(moved, proposal=None)

            await self.runs.update(account, req.run_id, None, to_queued)
            await self.backends.publish_work(req.run_id, msgspec.json.encode(restart), msg_id)
        final = await self.runs.get(account, req.run_id)
        return (
            MutationResult(
                run_id=req.run_id,
                action=action,
                state=final.state,
                replay=existing is not None,
                **target_ids(view, req.idempotency_key),
            ),
            "replay: this idempotency key already approved the restart" if existing is not None else None,
        )

    async def lease(self, req: LeaseQuery) -> LeaseAnswer:
        """Grant or renew a trainer's lease (each renewal is its heartbeat); see liveness.py."""
        account = await self.runs.owner(req.run_id)
        if account is None:
            return LeaseAnswer(run_id=req.run_id, proceed=False)
        if req.epoch == 0:  # a new lease: the work item in the trainer's hands must be this run's
            view = await self.runs.get(account, req.run_id)
            if view is None or not binding_matches(view, req):
                log.warning("run %s: lease refused, the work item does not match the run record", req.run_id)
                return LeaseAnswer(run_id=req.run_id, proceed=False)
        granted, view, epoch = await self.runs.lease(
            account,
            req.run_id,
            req.trainer_id,
            req.epoch,
            time.time(),
            liveness.SILENCE_S,
            lambda v: v.state in LEASABLE,
        )
        return LeaseAnswer(
            run_id=req.run_id, proceed=granted, state=view.state if view else None, epoch=epoch
        )
