"""A process that has exited is not alive, whoever reaps it: the stack's `down` and every wait on
a server or a service read `infra.alive`. A stopped service whose parent (`up --detach`) is gone is
reparented to init, which may reap it only seconds later; meanwhile it is a zombie, and
`kill(pid, 0)` still succeeds on a zombie. Counted as alive, every stop waited for init's reaping."""

import signal
import subprocess
import sys
import time

from devstack import infra


def test_a_running_process_is_alive_and_an_exited_one_is_not_even_before_it_is_reaped():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert infra.alive(proc.pid)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while infra.alive(proc.pid) and time.monotonic() < deadline:  # unreaped: a zombie, ours
            time.sleep(0.01)
        assert not infra.alive(proc.pid)
        assert proc.poll() is not None  # reaped only now: it was a zombie while alive() said False
    finally:
        proc.kill()
        proc.wait()


def test_a_pid_that_never_was_is_not_alive():
    assert not infra.alive(2**22 + 12345)  # above the kernel's pid_max: no such process


def test_stop_pids_returns_once_the_processes_exited_though_nobody_reaped_them():
    """`stop_pids` reaps its own children; another's child it cannot reap. Here its parent never
    reaps it (a shell that became `sleep`), as init may not for seconds: the exited process is a
    zombie, and `stop_pids` must see it stopped rather than count it alive until its timeout."""
    parent = subprocess.Popen(
        ["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!; exec sleep 60"], stdout=subprocess.PIPE, text=True
    )
    try:
        child = int(parent.stdout.readline())
        assert infra.alive(child)
        infra.stop_pids([child], timeout=5)
        assert not infra.alive(child)
        assert parent.poll() is None  # its parent still holds it unreaped: a zombie
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
