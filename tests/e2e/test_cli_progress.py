"""What a person sees in a terminal, read off a real one (tmux): `ecc ito status --follow` draws one
bar per stage that updates in place (its step grows, the screen does not scroll a line per step),
then the gate's verdict and the run's final state; `ecc ito metrics RUN` draws each stage's loss
sparkline."""

import os
import pathlib
import re
import shutil
import subprocess

import pytest

from tests.conftest import BIN
from tests.support import confirm_and_train, eventually

pytestmark = pytest.mark.e2e

STEPS = 400  # the tiny model trains ~30 steps/s here: long enough to watch a dozen polls
WIDTH, HEIGHT = 120, 30
BAR = re.compile(r"^pretrain\s+\S+\s+(\d+)/(\d+)\s")  # name, the bar, then `step/total`
SPARKLINE = re.compile(
    rf"^pretrain\s+[▁▂▃▄▅▆▇█]+\s+loss \d+\.\d{{4}} -> \d+\.\d{{4}}, min \d+\.\d{{4}}, "
    rf"steps \d+-{STEPS}/{STEPS}, \d+ tok/s$"
)


class Terminal:
    """A tmux server of its own (its own socket, no user config) whose panes run with `env`: the
    server takes the environment of the command that starts it."""

    def __init__(self, socket: pathlib.Path, env: dict[str, str]) -> None:
        if shutil.which("tmux") is None:
            pytest.fail("tmux is missing: `.ci/system-deps` (make sysdeps) installs it")
        self.socket = os.fspath(socket)  # in the test's tmp dir: nothing left behind in /tmp/tmux-UID
        self.env = env

    def tmux(self, *args: str) -> str:
        proc = subprocess.run(
            ["tmux", "-u", "-f", "/dev/null", "-S", self.socket, *args],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=10,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    def start(self, name: str, command: str) -> None:
        """`command` in a new WIDTHxHEIGHT session; the pane stays open after it, with its exit code."""
        shell = f"{command}; echo ECC-EXIT=$?; sleep 600"
        self.tmux("new-session", "-d", "-s", name, "-x", str(WIDTH), "-y", str(HEIGHT), shell)

    def screen(self, name: str) -> list[str]:
        """The pane as a person sees it now, and every line that scrolled off above it (-S -), each
        line whole where the terminal wrapped it (-J)."""
        out = self.tmux("capture-pane", "-p", "-J", "-t", name, "-S", "-", "-E", "-")
        return [ln.rstrip() for ln in out.splitlines() if ln.strip()]

    def close(self) -> None:
        subprocess.run(["tmux", "-S", self.socket, "kill-server"], capture_output=True, timeout=10)


def said(line: str) -> bool:
    """A line printed above the bars: a log line or the run's state."""
    return line.startswith(("  log: ", "  state: "))


def exited(terminal: Terminal, name: str, timeout: float) -> list[str]:
    def probe():
        lines = terminal.screen(name)
        return lines if any(ln.startswith("ECC-EXIT=") for ln in lines) else None

    return eventually(probe, timeout=timeout, interval=0.5, what=f"`{name}` to finish")


def test_a_terminal_shows_bars_in_place_then_the_verdict_and_sparklines(stack, manifest, tmp_path):
    account, _, env = stack.account()
    booking = stack.booking(account)
    target = {"tokens": STEPS * 8 * 32, "seq_len": 32, "batch_size": 8, "learning_rate": 0.003}
    train = confirm_and_train(stack, env, booking, str(manifest(target=target)), "tty-1")
    run_id = train["data"]["run_id"]
    tty_env = {**stack.env, **env, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TERM": "xterm-256color"}
    for inherited in ("TMUX", "COLUMNS", "LINES", "TTY_COMPATIBLE", "FORCE_COLOR", "NO_COLOR"):
        tty_env.pop(inherited, None)  # the pane's own size and kind decide, as on a person's terminal
    ecc = os.fspath(BIN / "ecc")
    terminal = Terminal(tmp_path / "tmux.sock", tty_env)
    try:
        terminal.start("follow", f"{ecc} ito status {run_id} --follow")
        seen: list[tuple[int, list[str]]] = []  # (the bar's step, the whole screen) while running

        def watch():
            lines = terminal.screen("follow")
            if any(ln.startswith("ECC-EXIT=") for ln in lines):
                return "ended"
            steps = [int(m.group(1)) for ln in lines if (m := BAR.match(ln))]
            if steps and steps[0] < STEPS:
                seen.append((steps[0], lines))
            return len({step for step, _ in seen}) >= 4

        eventually(watch, timeout=180, interval=0.2, what="the pretrain bar to move")
        assert len({step for step, _ in seen}) >= 2, f"the bar never moved: {seen[-1:] or 'no bar'}"
        for _, lines in seen:
            # every line but the log and state lines is a stage's bar, redrawn in place: no line per step
            assert [ln.split()[0] for ln in lines if not said(ln)] == ["data_prep", "pretrain"], lines
            assert any(ln.startswith("  state: running") for ln in lines), lines
        assert seen[-1][0] > seen[0][0]

        final = exited(terminal, "follow", timeout=240)
        assert "ECC-EXIT=0" in final, final
        summary = next(i for i, ln in enumerate(final) if ln.startswith(f"run {run_id}: succeeded"))
        prep, bar = final[summary - 2 : summary]  # above the summary: the bars, drawn in place
        assert prep.startswith("data_prep ") and prep.endswith(" done"), final
        assert BAR.match(bar) and f" {STEPS}/{STEPS} " in bar and bar.endswith(" done"), final
        # above the bars: log and state lines, and the gate's verdict once. The verdict comes with a
        # poll of the run and log lines with its event stream, so the stage's last log line may land
        # after it (seen on a busy machine): its place among them is not asserted.
        above = final[: summary - 2]
        verdicts = [ln for ln in above if ln.startswith("gate ")]
        assert len(verdicts) == 1, final
        assert re.match(
            r"^gate pretrain: passed: held-out loss \d+\.\d{4} must be at most \d", verdicts[0]
        ), final
        assert all(said(ln) for ln in above if ln not in verdicts), final

        terminal.start("metrics", f"{ecc} ito metrics {run_id}")
        curves = exited(terminal, "metrics", timeout=60)
        assert "ECC-EXIT=0" in curves, curves
        assert [ln for ln in curves if SPARKLINE.match(ln)], curves
    finally:
        terminal.close()
