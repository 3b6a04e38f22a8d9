"""How the training thread reports: typed builders of the run's contract events, handed to a sink.

Every stage, the loop and the ladder report through a `Reporter`; each method builds one event of
`contracts.runs` (envelope included: run id, lease epoch, time; `seq` 0 until the emitter assigns it
on the event loop) and hands it to the sink. A sink is one protocol, `Sink` (a callable taking a
contract event), with three kinds behind it: the agent's emitter (to the bus, through the spike
watch), an `EventFile` (JSON lines on disk: a gang's rank 0, a follower node), and a `Recorder`
(memory: tests and the bench).
"""

import pathlib
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TypedDict, TypeVar

import msgspec

from contracts.evals import EvalMetric, ProvenanceStep
from contracts.runs import (
    CheckpointSaved,
    DataProvenance,
    EvalResult,
    LogLevel,
    LogLine,
    Metrics,
    ParallelismStarted,
    RunEvent,
    RunEventBase,
    StageStarted,
)
from training.engine import distributed

Sink = Callable[[RunEvent], None]
E = TypeVar("E", bound=RunEventBase)


class Envelope(TypedDict):
    """`RunEventBase`'s fields, as a reporter stamps them on each event it builds."""

    run_id: str
    seq: int
    at: datetime
    epoch: int


def where(path: "str | pathlib.Path") -> str:
    """A directory as a run's log names it: its last two parts (`pretrain/step-00000012`,
    `<run id>/sft`), or a base model by its digest; never the server's own directories (issue 39:
    `sft starts from <data dir>/.ito/models/<digest>` reached the tenant's log)."""
    parts = pathlib.Path(path).parts
    if parts and len(parts[-1]) == 64 and all(c in "0123456789abcdef" for c in parts[-1]):
        return f"the base model sha256:{parts[-1]}"
    return "/".join(parts[-2:])


def check_event(event: object) -> RunEvent:
    """The event itself if it is a contract event; TypeError for anything else (a dict above all)."""
    if not isinstance(event, RunEventBase):
        raise TypeError(f"a run event must be a contracts.runs Struct, not {type(event).__name__}")
    return event  # type: ignore[return-value]  # RunEventBase's subclasses are exactly RunEvent's members


class Reporter:
    """The training thread's typed reporting interface; no method takes an untyped payload."""

    def __init__(self, sink: Sink, run_id: str = "", epoch: int = 0) -> None:
        self.sink = sink
        self.run_id = run_id
        self.epoch = epoch  # the lease epoch: the scheduler drops events of a fenced epoch

    def send(self, event: RunEvent) -> None:
        self.sink(check_event(event))

    def with_sink(self, sink: Sink) -> "Reporter":
        """The same run and epoch, reporting to another sink (a filter in front of this one)."""
        return Reporter(sink, self.run_id, self.epoch)

    def _envelope(self) -> "Envelope":
        """The fields every event of this reporter carries, stamped now."""
        return Envelope(run_id=self.run_id, seq=0, at=_now(), epoch=self.epoch)

    def log(self, message: str, level: LogLevel = LogLevel.info) -> None:
        self.send(LogLine(**self._envelope(), level=level, message=message))

    def metrics(
        self,
        *,
        stage: str,
        step: int,
        total_steps: int,
        loss: float,
        learning_rate: float,
        tokens_per_s: float,
        grad_norm: float,
    ) -> None:
        self.send(
            Metrics(
                **self._envelope(),
                stage=stage,
                step=step,
                total_steps=total_steps,
                loss=loss,
                learning_rate=learning_rate,
                tokens_per_s=tokens_per_s,
                grad_norm=grad_norm,
            )
        )

    def checkpoint(self, *, step: int, path: str, size: int, stall_s: float, save_s: float) -> None:
        self.send(
            CheckpointSaved(
                **self._envelope(),
                step=step,
                path=path,
                bytes=size,
                stall_s=stall_s,
                save_s=save_s,
            )
        )

    def stage(self, stage: str, total_steps: int = 0) -> None:
        self.send(StageStarted(**self._envelope(), stage=stage, total_steps=total_steps))

    def eval(
        self, stage: str, metrics: list[EvalMetric], passed: bool, findings: list[str] | None = None
    ) -> None:
        self.send(
            EvalResult(
                **self._envelope(),
                stage=stage,
                metrics=metrics,
                passed=passed,
                findings=findings or [],
            )
        )

    def provenance(self, steps: list[ProvenanceStep], input_digest: str, output_digest: str) -> None:
        self.send(
            DataProvenance(
                **self._envelope(),
                steps=steps,
                input_digest=input_digest,
                output_digest=output_digest,
            )
        )

    def parallelism(self, *, stage: str, strategy: str, world_size: int, mesh: dict[str, int]) -> None:
        self.send(
            ParallelismStarted(
                **self._envelope(),
                stage=stage,
                strategy=strategy,
                world_size=world_size,
                mesh=mesh,
            )
        )


def _drop(event: RunEvent) -> None:
    check_event(event)  # a bad event is still a bug on every rank


def rank0_only(report: Reporter, rank: int | None = None) -> Reporter:
    """`report` on rank 0 (the one writer of a run's events), a reporter that drops every event on
    the other ranks, which run the same loop in step. `rank` defaults to this process's rank."""
    rank = distributed.rank() if rank is None else rank
    return report if rank == 0 else report.with_sink(_drop)


def _now() -> datetime:
    return datetime.now(UTC)


class EventFile:
    """A `Sink` writing each event as one JSON line, flushed; safe from several threads (a training
    thread and torchft's quorum thread). Read back with `launch.elastic.EventTail`."""

    def __init__(self, path: pathlib.Path | str) -> None:
        self._file = open(path, "ab")
        self._lock = threading.Lock()

    def __call__(self, event: RunEvent) -> None:
        line = msgspec.json.encode(check_event(event)) + b"\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(line)
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def __enter__(self) -> "EventFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Recorder(Reporter):
    """A reporter that keeps every event in order, in memory (tests, the bench)."""

    def __init__(self, run_id: str = "recorded") -> None:
        super().__init__(self.record, run_id=run_id)
        self.events: list[RunEvent] = []

    def record(self, event: RunEvent) -> None:
        self.events.append(check_event(event))

    def of(self, kind: type[E]) -> list[E]:
        return [e for e in self.events if isinstance(e, kind)]
