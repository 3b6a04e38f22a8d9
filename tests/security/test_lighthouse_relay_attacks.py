"""A stage's Lighthouse from a process that is not a node of the run (training/launch/
lighthouse_relay.py): it joins no quorum and learns nothing, and node 0's Lighthouse listens on
its loopback only. A node of the run reaches it through its sealed entry, as torchft's own client
(a replica group's Manager) does. `test_a_bare_lighthouse_answers_anyone` keeps the defect on record."""

import os
import socket
import threading
from urllib.parse import urlparse

import pytest

from runtime.security import sealed
from tests.security.conftest import read_until_closed
from training.engine.fault_tolerance import start_lighthouse
from training.launch import lighthouse_relay as lr
from training.launch.lighthouse_relay import Entry, Relay, relay_key
from training.launch.rendezvous import store_key

RUN = "run_0123456789abcdef01234567"
SECRET = "per-run-secret-minted-by-the-scheduler"
KEY = relay_key(SECRET, RUN)


def _host_address() -> str:
    """An address of this host that is not loopback (what another host would dial)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: only the route's source address
        except OSError:
            pytest.skip("this host has no route but loopback: nothing outside it to test from")
        return s.getsockname()[0]


@pytest.fixture
def node0():
    server = start_lighthouse("127.0.0.1:0")
    relay = Relay("127.0.0.1", urlparse(server.address()).port, KEY, RUN)
    yield server, relay
    relay.close()
    server.shutdown()


def _quorum_reachable(lighthouse: str) -> bool:
    """Whether torchft's own client reaches a Lighthouse at `lighthouse` (a heartbeat goes through)."""
    from torchft._torchft import LighthouseClient

    try:
        LighthouseClient(lighthouse, connect_timeout=__import__("datetime").timedelta(seconds=3)).heartbeat(
            "replica_9"
        )
        return True
    except Exception:
        return False


def test_a_bare_lighthouse_answers_anyone() -> None:
    """The defect: a Lighthouse bound as before ([::]) takes a heartbeat from any process, as a replica."""
    server = start_lighthouse("[::]:0")
    try:
        assert _quorum_reachable(f"http://127.0.0.1:{urlparse(server.address()).port}")
    finally:
        server.shutdown()


def test_node0s_lighthouse_listens_on_loopback_only(node0) -> None:
    server, _ = node0
    port, outside = urlparse(server.address()).port, _host_address()
    assert not outside.startswith("127.")
    with pytest.raises(OSError):
        socket.create_connection((outside, port), timeout=2).close()


def test_a_node_of_the_run_reaches_the_lighthouse_through_its_entry(node0) -> None:
    _, relay = node0
    entry = Entry(relay.address, KEY, RUN, node_rank=1, epoch=1)
    try:
        assert _quorum_reachable(entry.lighthouse)
    finally:
        entry.close()


@pytest.mark.parametrize(
    "key, run_id",
    [(relay_key("another-runs-secret", RUN), RUN), (KEY, "run_another"), (store_key(SECRET, RUN), RUN)],
    ids=["another runs key", "another run id", "the store's key"],
)
def test_another_runs_key_id_or_purpose_joins_nothing(node0, key, run_id) -> None:
    _, relay = node0
    entry = Entry(relay.address, key, run_id, node_rank=1, epoch=1)
    try:
        assert not _quorum_reachable(entry.lighthouse)
    finally:
        entry.close()
    assert relay.refused >= 1


def test_a_stranger_speaking_grpc_to_the_relay_gets_the_nonce_and_nothing_else(node0) -> None:
    _, relay = node0
    assert not _quorum_reachable(f"http://{relay.address}")
    sock = socket.create_connection(("127.0.0.1", relay.port), timeout=5)
    sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00" * 64)
    got = read_until_closed(sock)
    assert got.startswith(lr.MAGIC) and len(got) == len(lr.MAGIC) + sealed.NONCE_BYTES


def test_a_stale_lease_epoch_is_refused(node0) -> None:
    _, relay = node0
    fresh, stale = Entry(relay.address, KEY, RUN, 1, epoch=3), Entry(relay.address, KEY, RUN, 1, epoch=2)
    try:
        assert _quorum_reachable(fresh.lighthouse)
        assert not _quorum_reachable(stale.lighthouse)
    finally:
        fresh.close()
        stale.close()


def test_an_impostor_relay_is_not_believed() -> None:
    """An entry never carries a byte to a relay that does not prove it holds the run's key."""
    listener = socket.create_server(("127.0.0.1", 0))
    seen: list[bytes] = []

    def impostor() -> None:
        conn, _ = listener.accept()
        conn.sendall(lr.MAGIC + os.urandom(sealed.NONCE_BYTES))
        seen.append(sealed.recv_frame(conn, 4096))
        sealed.recv_frame(conn, 4096)
        sealed.send_frame(conn, os.urandom(32))
        conn.settimeout(3)
        try:
            seen.append(conn.recv(65536))
        except OSError:
            pass
        conn.close()

    threading.Thread(target=impostor, daemon=True).start()
    entry = Entry(f"127.0.0.1:{listener.getsockname()[1]}", KEY, RUN, node_rank=1, epoch=1)
    try:
        assert not _quorum_reachable(entry.lighthouse)
    finally:
        entry.close()
        listener.close()
    assert all(b"replica_9" not in chunk for chunk in seen)


def test_half_open_connections_stall_no_node(node0) -> None:
    _, relay = node0
    idle = [socket.create_connection(("127.0.0.1", relay.port), timeout=5) for _ in range(20)]
    entry = Entry(relay.address, KEY, RUN, node_rank=1, epoch=1)
    try:
        assert _quorum_reachable(entry.lighthouse)
    finally:
        entry.close()
        for s in idle:
            s.close()


@pytest.mark.parametrize(
    ("run_id", "epoch", "seen", "why"),
    [
        (RUN, 2, {1: 2}, None),
        (RUN, 3, {1: 2}, None),
        (RUN, 1, {1: 2}, "a stale lease epoch"),
        ("run_x", 2, {}, "another run"),
    ],
)
def test_admit(run_id, epoch, seen, why) -> None:
    assert sealed.admit(sealed.Hello(run_id, 1, epoch, b"n" * 16), RUN, dict(seen)) == why
