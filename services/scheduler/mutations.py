"""Cancel, cleanup and approve: separate, confirmed, idempotent mutations of a run.

Each mutation follows train's order: authenticate -> key format -> the run (tenant-scoped) ->
ledger lookup (a replay answers here) -> state check -> confirmation resolve -> ledger accept
(consumes the confirmation and reserves the key atomically) -> effect. State changes go through
`RunStore.move` (the state table's sets: contracts/states.py); the trainer's lease and heartbeat
are liveness.py's.
"""

import logging
from datetime import UTC, datetime
from typing import Any

import msgspec

from contracts.api import (
    Action,
    ApproveRequest,
    CancelRequest,
    CleanupOrder,
    CleanupRequest,
    CleanupResult,
    MutationResult,
    RestartProposal,
    RunView,
)
from contracts.errors import ErrorCode
from contracts.internal import LedgerAccept, LedgerEntry
from contracts.manifest import Manifest
from contracts.runs import TrainWork
from contracts.states import CANCEL_TO, CANCELLABLE, TERMINAL_STATES, RunState
from runtime.messaging.codec import Refusal
from runtime.tenancy.accounts import Credentials
from services.scheduler.admission import authenticate, fingerprint, key_conflict, key_refusal
from services.scheduler.handoff import node_shares
from services.scheduler.peers import Peers
from services.scheduler.store import RunRecords

log = logging.getLogger("ito.scheduler.mutations")

_cleanup_decoder = msgspec.json.Decoder(CleanupResult)
_work_decoder = msgspec.json.Decoder(TrainWork)
_manifest_decoder = msgspec.json.Decoder(Manifest)


def target_ids(view: RunView, key: str) -> dict[str, Any]:
    """The identifiers every mutation answer carries: its target run's and its own key."""
    return {"booking_id": view.booking_id, "manifest_digest": view.manifest_digest, "idempotency_key": key}


def rejected_message(proposal: RestartProposal) -> str:
    return (
        f"restart proposal rejected; the run stays paused at {proposal.stage} step "
        f"{proposal.spike_step}: cancel it, or confirm and approve a restart"
    )


def approved_message(proposal: RestartProposal) -> str:
    return (
        f"restart approved: from checkpoint step {proposal.checkpoint_step}, skipping batches "
        f"[{proposal.skip_from}, {proposal.skip_to})"
    )


class Mutations:
    def __init__(self, credentials: Credentials, peers: Peers, runs: RunRecords) -> None:
        self.credentials = credentials
        self.peers = peers
        self.runs = runs

    async def _run(self, caller: str, req: Any, run_id: str, key: str) -> tuple[str, RunView]:
        account = (await authenticate(self.credentials, caller, req)).account
        refusal = key_refusal(key)
        if refusal is not None:
            raise refusal
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
        await self.peers.resolve_confirmation(account, ref, action, target, None, None)
        return await self.peers.ledger_accept(
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
        entry = await self.peers.ledger_lookup(account, key)
        if entry is not None and entry.fingerprint != fingerprint(action, account, target, ""):
            raise key_conflict()
        return entry

    async def cancel(self, caller: str, req: CancelRequest) -> tuple[MutationResult, str | None]:
        account, view = await self._run(caller, req, req.run_id, req.idempotency_key)
        ids = target_ids(view, req.idempotency_key)
        if await self._existing(account, req.idempotency_key, Action.cancel, req.run_id) is not None:
            return (
                MutationResult(run_id=req.run_id, action=Action.cancel, state=view.state, replay=True, **ids),
                "replay: this idempotency key already cancelled this run",
            )
        if view.state not in CANCELLABLE:
            raise Refusal(ErrorCode.run_not_cancellable, f"the run is {view.state.value}")
        entry = await self._accept(
            account, req.idempotency_key, Action.cancel, req.run_id, req.confirmation_ref
        )
        if entry.fingerprint != fingerprint(Action.cancel, account, req.run_id, ""):
            raise key_conflict()
        updated, _ = await self.runs.move(account, req.run_id, CANCEL_TO, message="cancelled by the account")
        state = updated.state if updated is not None else view.state
        await self.peers.notify_cancel(req.run_id)
        log.info("run %s: cancel accepted (%s)", req.run_id, state.value)
        return MutationResult(run_id=req.run_id, action=Action.cancel, state=state, **ids), None

    async def cleanup(self, caller: str, req: CleanupRequest) -> tuple[CleanupResult, str | None]:
        """Remove a finished run's checkpoints (and, confirmed separately, release its booking)."""
        account, view = await self._run(caller, req, req.run_id, req.idempotency_key)
        if await self._existing(account, req.idempotency_key, Action.cleanup, req.run_id) is not None:
            return await self._cleanup_replay(account, view, req)
        release_ref = self._check_cleanup(view, req)
        if release_ref is not None:  # checked before anything is consumed, so a refusal changes nothing
            await self.peers.resolve_confirmation(
                account, release_ref, Action.release_booking, view.booking_id, None, None
            )
        await self._accept(account, req.idempotency_key, Action.cleanup, req.run_id, req.confirmation_ref)
        result = await self._remove_checkpoints(account, view)
        released = False
        if release_ref is not None:
            await self._release_booking(account, view, req, release_ref)
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

    async def _cleanup_replay(
        self, account: str, view: RunView, req: CleanupRequest
    ) -> tuple[CleanupResult, str | None]:
        stored = await self.runs.recall(account, req.run_id, "cleanup")
        result = _cleanup_decoder.decode(stored) if stored else CleanupResult(run_id=req.run_id, removed=[])
        return (
            msgspec.structs.replace(result, replay=True, **target_ids(view, req.idempotency_key)),
            "replay: this idempotency key already cleaned up this run",
        )

    @staticmethod
    def _check_cleanup(view: RunView, req: CleanupRequest) -> str | None:
        """Refuse an unfinished run or a release without its own confirmation; the release ref."""
        if view.state not in TERMINAL_STATES:
            raise Refusal(
                ErrorCode.run_not_finished, f"the run is {view.state.value}; cancel it or let it finish first"
            )
        if not req.release_booking:
            return None
        if not req.release_confirmation_ref:
            raise Refusal(
                ErrorCode.confirmation_required,
                "--release-booking needs its own `release_booking` confirmation (--release-confirmation-ref)",
            )
        return req.release_confirmation_ref

    async def _remove_checkpoints(self, account: str, view: RunView) -> CleanupResult:
        work = await self.runs.recall(account, view.run_id, "work")
        storage = (
            _manifest_decoder.decode(_work_decoder.decode(work).manifest_text).checkpoint.storage
            if work
            else "local"
        )
        order = CleanupOrder(
            account=account, run_id=view.run_id, checkpoint_dir=view.checkpoint_dir or "", storage=storage
        )
        result = await self.peers.trainer_cleanup(order)
        await self.runs.forget_checkpoints(account, view.run_id)
        return result

    async def _release_booking(self, account: str, view: RunView, req: CleanupRequest, ref: str) -> None:
        await self.peers.ledger_accept(
            LedgerAccept(
                account=account,
                idempotency_key=f"{req.idempotency_key}#release_booking",
                fingerprint=fingerprint(Action.release_booking, account, view.booking_id, ""),
                run_id=req.run_id,
                action=Action.release_booking,
                confirmation_ref=ref,
                target=view.booking_id,
            )
        )
        await self.peers.request_release(account, view.booking_id, req.run_id)

    async def approve(self, caller: str, req: ApproveRequest) -> tuple[MutationResult, str | None]:
        """A paused run's restart proposal: approved only with a `restart_from_checkpoint`
        confirmation for this run; rejected, the run stays paused and says so. Never automatic."""
        account, view = await self._run(caller, req, req.run_id, req.idempotency_key)
        action = Action.restart_from_checkpoint
        ids = target_ids(view, req.idempotency_key)
        existing = await self._existing(account, req.idempotency_key, action, req.run_id)
        if existing is None and (view.state is not RunState.awaiting_approval or view.proposal is None):
            raise Refusal(
                ErrorCode.proposal_not_found, f"the run is {view.state.value} with no proposal to decide"
            )
        if req.reject and view.proposal is not None:
            message = rejected_message(view.proposal)
            updated, _ = await self.runs.update(
                account,
                req.run_id,
                None,
                lambda v: msgspec.structs.replace(v, message=message, updated_at=datetime.now(UTC)),
            )
            state = updated.state if updated is not None else view.state
            return MutationResult(run_id=req.run_id, action=action, state=state, **ids), message
        if existing is None:
            await self._accept(account, req.idempotency_key, action, req.run_id, req.confirmation_ref)
        await self._restart(account, req)
        final = await self.runs.get(account, req.run_id)
        return (
            MutationResult(
                run_id=req.run_id,
                action=action,
                state=final.state if final is not None else view.state,
                replay=existing is not None,
                **ids,
            ),
            "replay: this idempotency key already approved the restart" if existing is not None else None,
        )

    async def _restart(self, account: str, req: ApproveRequest) -> None:
        """Queue the approved restart (again on a replay, if the first attempt died before this
        point: publishing is idempotent)."""
        current = await self.runs.get(account, req.run_id)
        if current is None or current.state is not RunState.awaiting_approval or current.proposal is None:
            return
        stored = await self.runs.recall(account, req.run_id, "work")
        if stored is None:
            raise Refusal(ErrorCode.proposal_not_found, "the run's work item is gone; it cannot restart")
        restart = msgspec.structs.replace(_work_decoder.decode(stored), restart=current.proposal)
        action = Action.restart_from_checkpoint
        msg_id = f"{req.run_id}:restart:{fingerprint(action, account, req.run_id, req.idempotency_key)[:16]}"
        await self.runs.move(
            account,
            req.run_id,
            RunState.queued,
            allowed_from=frozenset({RunState.awaiting_approval}),
            message=approved_message(current.proposal),
            proposal=None,
        )
        for share, share_id in node_shares(restart, msg_id):  # a multi-node run restarts on every node
            await self.peers.publish_work(req.run_id, msgspec.json.encode(share), share_id)
