"""The desk's pages as HTML: a layout, and each page's sections.

A page is a few sections, each a pure function of the board's values to an HTML fragment with an
id. The first load renders them all; the page's event stream (services/desk/web.py) sends a
section again, whole, whenever its HTML changes, and the page's one small script swaps it in. So
what a person sees live and after a reload is the same text. Everything from outside is escaped.
"""

from collections.abc import Callable
from datetime import datetime
from html import escape

from contracts.states import TERMINAL_STATES
from contracts.telemetry import BOOKED_BADPUT
from services.desk import charts
from services.desk.board import Breakdown, RunDetail, RunRow, cost_so_far, stage_losses

Sections = dict[str, str]


def layout(title: str, sections: Sections, order: list[str], events: str, heading: str) -> str:
    """A whole page: its sections in `order`, listening to `events` for new versions of them."""
    body = "\n".join(f'<section id="{sid}" class="card">{sections[sid]}</section>' for sid in order)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{escape(title)} · ito-training desk</title>
<link rel="stylesheet" href="/static/desk.css"></head>
<body data-events="{escape(events)}">
<header><nav><a href="/" class="brand">ito-training desk</a><a href="/">Runs</a><a href="/desk">Desk</a></nav>
<span id="live" class="live" title="live updates">●</span>
<form method="post" action="/logout"><button type="submit">Log out</button></form></header>
<main><h1>{escape(heading)}</h1>
{body}
</main><script src="/static/desk.js"></script></body></html>"""


def login_page(message: str = "") -> str:
    note = f'<p class="error">{escape(message)}</p>' if message else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Log in · ito-training desk</title><link rel="stylesheet" href="/static/desk.css"></head>
<body class="login"><main><h1>ito-training desk</h1>{note}
<form method="post" action="/login" id="login">
<label for="token">Operator token</label>
<input id="token" name="token" type="password" autocomplete="off" required>
<button type="submit">Log in</button></form>
<p class="hint">The token is in the secrets dir (<code>tokens/desk.token</code>, mode 0600).</p>
</main><script src="/static/login.js"></script></body></html>"""


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.1%}"


def _usd(x: float | None) -> str:
    return "–" if x is None else f"${x:,.4f}" if x < 100 else f"${x:,.0f}"


def _when(at: datetime) -> str:
    return at.strftime("%Y-%m-%d %H:%M:%S")


def _badge(state: str) -> str:
    return f'<span class="badge s-{escape(state)}">{escape(state)}</span>'


def _bar(step: int, total: int) -> str:
    return f'<span class="steps"><progress max="{max(total, 1)}" value="{min(step, max(total, 1))}"></progress> {step}/{total}</span>'


# --- the runs page ---


def runs_sections(rows: list[RunRow]) -> Sections:
    if not rows:
        return {"runs": '<p class="empty">No runs yet. Start one with <code>ecc ito train</code>.</p>'}
    body = "".join(
        f'<tr data-run="{escape(r.run_id)}">'
        f'<td data-label="run"><a href="/runs/{escape(r.run_id)}">{escape(r.run_id)}</a></td>'
        f'<td data-label="account">{escape(r.account)}</td><td data-label="booking">{escape(r.booking_id)}</td>'
        f'<td data-label="state">{_badge(r.state)}</td><td data-label="stage">{escape(r.stage) or "–"}</td>'
        f'<td data-label="step">{_bar(r.step, r.total_steps)}</td>'
        f'<td data-label="goodput" class="num">{_pct(r.goodput)}</td>'
        f'<td data-label="cost so far / estimate" class="num">{_usd(r.cost_so_far_usd)} / {_usd(r.estimate_usd)}</td>'
        f'<td data-label="GPUs">{escape(r.gpu_model)} × {r.gpus}</td>'
        f'<td data-label="updated">{_when(r.updated_at)}</td></tr>'
        for r in rows
    )
    return {
        "runs": '<div class="scroll"><table class="runs"><thead><tr><th>run</th><th>account</th>'
        "<th>booking</th><th>state</th><th>stage</th><th>step</th><th>goodput</th>"
        "<th>cost so far / estimate</th><th>GPUs</th><th>updated</th></tr></thead>"
        f"<tbody>{body}</tbody></table></div>"
    }


RUNS_ORDER = ["runs"]


# --- one run ---


def _summary(d: RunDetail, now: datetime, goodput: float | None) -> str:
    v = d.view
    rows = [
        ("state", _badge(v.state.value)),
        ("account", escape(v.account)),
        ("booking", escape(v.booking_id)),
        ("stage", f"{escape(v.stage or '–')} {_bar(v.step, v.total_steps)}"),
        ("loss", "–" if v.loss is None else f"{v.loss:.4f}"),
        ("goodput", _pct(goodput)),
    ]
    if v.plan is not None:
        c = v.plan.cost
        rows.append(("cost so far / estimate", f"{_usd(cost_so_far(v, now))} / {_usd(c.total_usd)}"))
        rows.append(
            (
                "plan",
                f"{escape(v.plan.strategy)} on {c.gpus} × {escape(v.plan.gpu_model)}, {escape(v.plan.precision)}",
            )
        )
    if v.parallelism is not None:
        mesh = " × ".join(f"{escape(k)} {n}" for k, n in v.parallelism.mesh.items()) or "none"
        rows.append(
            (
                "parallelism",
                f"{escape(v.parallelism.strategy)}, world size {v.parallelism.world_size}, mesh {mesh}",
            )
        )
    if v.message:
        rows.append(("message", escape(v.message)))
    if v.proposal is not None:
        p = v.proposal
        rows.append(
            (
                "proposal",
                f"{escape(p.reason)}: restart {escape(p.stage)} from step {p.checkpoint_step}, "
                f"skip batches [{p.skip_from}, {p.skip_to})",
            )
        )
    return '<dl class="summary">' + "".join(f"<dt>{k}</dt><dd>{val}</dd>" for k, val in rows) + "</dl>"


def _losses(d: RunDetail) -> str:
    stages = stage_losses(d)
    if not stages:
        return '<h2>Loss</h2><p class="empty">No steps yet.</p>'
    figures = "".join(
        f'<figure class="stage-loss" data-stage="{escape(s.stage)}"><figcaption>{escape(s.stage)}: '
        f"{len(s.points)} steps"
        + (f", last loss {s.points[-1][1]:.4f}" if s.points else "")
        + "".join(f", {escape(n)} {v:.4f}" for n, v, _ in s.held_out)
        + f"</figcaption>{charts.loss_chart(s)}</figure>"
        for s in stages
    )
    legend = (
        '<p class="legend"><span class="key train-loss"></span>training loss per step '
        '<span class="key held-out"></span>held-out loss at the gate <span class="key threshold"></span>gate threshold</p>'
    )
    return f'<h2>Loss per stage</h2>{legend}<div class="grid">{figures}</div>'


def _gates(d: RunDetail) -> str:
    if not d.view.gates:
        return '<h2>Gates</h2><p class="empty">No stage has been evaluated yet.</p>'
    bodies = []
    for g in d.view.gates:
        verdict = "passed" if g.passed else "failed"
        head = (
            f'<tr class="gate-head"><th colspan="4">{escape(g.stage)}</th>'
            f'<td><span class="verdict {verdict}">{verdict}</span></td></tr>'
        )
        metrics = "".join(
            f'<tr><td>{escape(m.name)}</td><td class="num">{m.value:.4f}</td><td>{escape(m.op)}</td>'
            f'<td class="num">{"reported" if m.threshold is None else f"{m.threshold:.4f}"}</td>'
            f"<td>{'ok' if m.passed else 'FAIL'}</td></tr>"
            + (
                f'<tr class="gate-sentence"><td colspan="5">{escape(m.sentence)}</td></tr>'
                if m.sentence
                else ""
            )
            for m in g.metrics
        )
        metrics += "".join(
            f'<tr class="gate-finding"><td colspan="5">finding: {escape(f)}</td></tr>' for f in g.findings
        )
        bodies.append(
            f'<tbody class="gate" data-stage="{escape(g.stage)}" data-verdict="{verdict}">{head}{metrics}</tbody>'
        )
    return (
        '<h2>Gates</h2><div class="scroll"><table class="gates"><thead><tr><th>metric</th><th>value</th>'
        f"<th>op</th><th>threshold</th><th>verdict</th></tr></thead>{''.join(bodies)}</table></div>"
    )


def _timeline(d: RunDetail, now: datetime) -> str:
    legend = (
        '<p class="legend"><span class="key s-running"></span>running <span class="key s-queued"></span>queued '
        '<span class="key s-interrupted"></span>interrupted <span class="key checkpoint"></span>checkpoint '
        '<span class="key interruption"></span>interruption <span class="key recovery"></span>recovery</p>'
    )
    return (
        f"<h2>Timeline</h2>{legend}{charts.timeline(d, now)}"
        f'<p class="meta">{len(d.interruptions)} interruption(s), {len(d.checkpoints)} checkpoint(s), '
        f"{len(d.states)} state change(s)</p>"
    )


def _table(heads: list[str], body: str, cls: str = "") -> str:
    """A table that scrolls sideways in its card on a narrow screen; `body` is its rows' HTML."""
    head = "".join(f"<th>{h}</th>" for h in heads)
    klass = f' class="{cls}"' if cls else ""
    return (
        f'<div class="scroll"><table{klass}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'
    )


def _checkpoints(d: RunDetail) -> str:
    if not d.checkpoints:
        return '<h2>Checkpoints</h2><p class="empty">None committed yet.</p>'
    rows = "".join(
        f'<tr><td class="num">{c.step}</td><td class="num">{c.bytes / 1e6:.1f} MB</td>'
        f'<td class="num">{c.stall_s * 1000:.1f} ms</td><td class="num">{c.save_s:.2f} s</td>'
        f'<td class="num">{(c.bytes / c.save_s / 1e6 if c.save_s > 0 else 0):.1f} MB/s</td></tr>'
        for c in d.checkpoints
    )
    return "<h2>Checkpoints</h2>" + _table(["step", "size", "loop stall", "save", "bandwidth"], rows)


def _provenance(d: RunDetail) -> str:
    p = d.view.provenance
    if p is None:
        return '<h2>Data provenance</h2><p class="empty">No data preparation recorded.</p>'
    rows = "".join(
        f'<tr><td>{escape(s.name)}</td><td class="num">{s.before}</td><td class="num">{s.after}</td>'
        f"<td>{escape(s.detail or '')}</td></tr>"
        for s in p.steps
    )
    return (
        "<h2>Data provenance</h2>"
        + _table(["step", "before", "after", "detail"], rows)
        + f'<p class="meta">input <code>{escape(p.input_digest[:16])}…</code> → output '
        f"<code>{escape(p.output_digest[:16])}…</code></p>"
    )


def _audit(d: RunDetail) -> str:
    if not d.audit:
        return '<h2>Audit trail</h2><p class="empty">No decisions read yet.</p>'
    rows = "".join(
        f"<tr><td>{_when(x.at)}</td><td>{escape(x.action.value)}</td><td>{escape(x.gate)}</td>"
        f"<td>{'pass' if x.ok else 'FAIL ' + escape(x.code or '')}</td></tr>"
        for x in d.audit
    )
    return "<h2>Audit trail</h2>" + _table(["at", "action", "gate", "decision"], rows, "audit")


def _logs(d: RunDetail) -> str:
    if not d.logs:
        return '<h2>Log</h2><p class="empty">No lines yet.</p>'
    lines = "\n".join(f"{_when(ln.at)} {escape(ln.level)}: {escape(ln.message)}" for ln in d.logs[-40:])
    return f'<h2>Log</h2><pre class="log">{lines}</pre>'


def run_sections(d: RunDetail, now: datetime, goodput: float | None) -> Sections:
    return {
        "summary": _summary(d, now, goodput),
        "loss": _losses(d),
        "gates": _gates(d),
        "timeline": _timeline(d, now),
        "checkpoints": _checkpoints(d),
        "provenance": _provenance(d),
        "audit": _audit(d),
        "logs": _logs(d),
    }


RUN_ORDER = ["summary", "loss", "gates", "timeline", "checkpoints", "provenance", "audit", "logs"]


def run_finished(d: RunDetail) -> bool:
    return d.view.state in TERMINAL_STATES


# --- the desk ---


def _by(rows: list[Breakdown], cell: Callable[[Breakdown], str], head: str) -> str:
    groups = []
    for by in ("gpu_model", "region", "booking"):
        mine = [r for r in rows if r.by == by]
        if mine:
            body = "".join(
                f'<tr data-key="{escape(r.key)}"><td>{escape(r.key)}</td>{cell(r)}</tr>' for r in mine
            )
            groups.append(
                f'<h3>by {by.replace("_", " ")}</h3><div class="scroll"><table data-by="{by}"><thead><tr><th>{by}</th>'
                f"{head}</tr></thead><tbody>{body}</tbody></table></div>"
            )
    return "".join(groups)


def desk_sections(rows: list[Breakdown], prices: dict[str, float]) -> Sections:
    if not rows:
        empty = '<p class="empty">No finished runs yet: telemetry accounts a run when it ends.</p>'
        return {
            "breakdown": "<h2>Goodput and badput</h2>" + empty,
            "interruptions": "",
            "bandwidth": "",
            "prices": "",
        }
    legend = (
        '<p class="legend">'
        + "".join(
            f'<span class="key seg-{c}"></span>{c.replace("_", " ")} ' for c in ("goodput", *BOOKED_BADPUT)
        )
        + "</p>"
    )
    breakdown = _by(
        rows,
        lambda r: (
            f'<td class="num">{r.runs}</td><td class="num">{r.wall_gpu_hours:.4f}</td>'
            f'<td class="num">{r.booked_gpu_hours:.4f}</td><td class="num">{r.idle_gpu_hours:.4f}</td>'
            f'<td class="num">{_pct(r.goodput)}</td><td class="bar">{charts.stacked_bar(r.goodput, r.shares)}</td>'
        ),
        "<th>runs</th><th>GPU-h</th><th>booked GPU-h</th><th>idle GPU-h</th><th>goodput</th>"
        "<th>where the booked GPU-hours went</th>",
    )
    interruptions = _by(
        rows,
        lambda r: (
            f'<td class="num">{r.interruptions}</td><td class="num">{r.interruptions_per_1000_gpu_hours:.1f}</td>'
            f"<td>{escape(', '.join(f'{c} {n}' for c, n in sorted(r.causes.items())) or '–')}</td>"
        ),
        "<th>interruptions</th><th>per 1,000 GPU-h</th><th>causes</th>",
    )
    bandwidth = _by(
        rows,
        lambda r: (
            f'<td class="num">{_mbps(r.checkpoint_p50)}</td><td class="num">{_mbps(r.checkpoint_min)}</td>'
        ),
        "<th>checkpoint p50</th><th>min</th>",
    )
    price_rows = _by(
        rows,
        lambda r: (
            f'<td class="num">{_usd(prices.get(r.key)) if r.by == "gpu_model" else "–"}</td>'
            f'<td class="num">{_pct(r.goodput)}</td><td class="num">{_usd(r.implied_usd_per_useful_gpu_hour)}</td>'
        ),
        "<th>list price / GPU-h</th><th>goodput of booked</th><th>implied price / useful GPU-h</th>",
    )
    return {
        "breakdown": f"<h2>Goodput and badput</h2>{legend}{breakdown}",
        "interruptions": f"<h2>Interruptions</h2>{interruptions}",
        "bandwidth": f"<h2>Checkpoint bandwidth</h2>{bandwidth}",
        "prices": '<h2>Price per useful GPU-hour</h2><p class="meta">booked GPU-hours (every GPU of '
        "each booking, its whole window, idle ones included) at the desk's "
        f"price (desk_prices.json) over the GPU-hours of goodput</p>{price_rows}",
    }


DESK_ORDER = ["breakdown", "interruptions", "bandwidth", "prices"]


def _mbps(x: float | None) -> str:
    return "–" if x is None else f"{x / 1e6:.1f} MB/s"
