"""`ito-training desk telemetry [--follow] [--json]`: the desk's view of `desk.telemetry.>`.

It replays the stream from its start (a late subscriber misses nothing), keeps the latest rollup
per booking, region and GPU model, and prints them as a table; `--follow` keeps printing updates.
"""

import asyncio
import json
import sys

import msgspec

from contracts import subjects
from contracts.telemetry import BADPUT, Rollup, RunTelemetry
from runtime.configuration.settings import Settings

IDLE_FETCH_S = 1.0  # without --follow: stop once the stream has had nothing new for this long
_rollup = msgspec.json.Decoder(Rollup)
_run = msgspec.json.Decoder(RunTelemetry)


def table(rollups: dict[tuple[str, str], Rollup]) -> str:
    header = (
        f"{'by':<10} {'key':<24} {'runs':>4} {'GPU-h':>9} {'goodput':>8} "
        + " ".join(f"{c[:10]:>10}" for c in BADPUT)
        + f" {'intr/1kGPUh':>11} {'ckpt MB/s p50':>13} {'min':>8}"
    )
    rows = [header]
    for (by, key), r in sorted(rollups.items()):
        share = {
            c: (r.badput_gpu_hours.get(c, 0.0) / r.wall_gpu_hours if r.wall_gpu_hours else 0.0)
            for c in BADPUT
        }
        p50 = "-" if r.checkpoint_bytes_per_s_p50 is None else f"{r.checkpoint_bytes_per_s_p50 / 1e6:.1f}"
        low = "-" if r.checkpoint_bytes_per_s_min is None else f"{r.checkpoint_bytes_per_s_min / 1e6:.1f}"
        rows.append(
            f"{by:<10} {key[:24]:<24} {r.runs:>4} {r.wall_gpu_hours:>9.4f} {r.goodput:>7.1%} "
            + " ".join(f"{share[c]:>10.1%}" for c in BADPUT)
            + f" {r.interruptions_per_1000_gpu_hours:>11.1f} {p50:>13} {low:>8}"
        )
    return "\n".join(rows)


async def telemetry(settings: Settings, follow: bool, as_json: bool) -> int:
    import nats
    from nats.js.api import ConsumerConfig, DeliverPolicy

    from devstack.authority import connect
    from runtime.security.identities import DESK

    nc = await connect(settings, DESK)  # read-only: desk telemetry and nothing else
    try:
        js = nc.jetstream(timeout=settings.request_timeout_s)
        sub = await js.subscribe(
            settings.desk_subject_root() + ".>",
            ordered_consumer=True,
            stream=settings.stream(subjects.STREAM_DESK),  # no stream lookup: not ours to ask
            config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
        )
        rollups: dict[tuple[str, str], Rollup] = {}
        while True:
            try:
                msg = await sub.next_msg(timeout=IDLE_FETCH_S)
            except (TimeoutError, nats.errors.TimeoutError):
                if not follow:
                    break
                continue
            kind = msg.subject[len(settings.desk_subject_root()) + 1 :].split(".", 1)[0]
            if kind == "rollup":
                r = _rollup.decode(msg.data)
                rollups[(r.by, r.key)] = r
                if follow:
                    print(
                        msgspec.json.encode(r).decode() if as_json else table({(r.by, r.key): r}), flush=True
                    )
            elif kind == "run" and follow and as_json:
                print(msgspec.json.encode(_run.decode(msg.data)).decode(), flush=True)
        if as_json:
            print(json.dumps([msgspec.to_builtins(r) for r in rollups.values()]))
        else:
            print(table(rollups) if rollups else "(no telemetry yet)")
        return 0
    finally:
        await nc.close()


def main(settings: Settings, follow: bool, as_json: bool) -> int:
    try:
        return asyncio.run(telemetry(settings, follow, as_json))
    except KeyboardInterrupt:
        return 0
    except OSError as exc:
        print(f"ito-training desk telemetry: cannot reach NATS: {exc}", file=sys.stderr)
        return 1
