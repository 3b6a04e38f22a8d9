"""Node 0's rendezvous store from a process that is not a node of the run: it reads nothing,
writes nothing and stalls nothing (training/launch/rendezvous.py). On today's TCPStore each
of these attacks succeeds: `test_tcpstore_answers_anyone` keeps the contrast on record."""

import hashlib
import hmac
import socket
import threading
import time
from datetime import timedelta

import msgspec
import pytest
from torch.distributed import TCPStore

from runtime.security import sealed
from tests.security.conftest import read_until_closed
from training.launch import rendezvous as rs
from training.launch.rendezvous import (
    Hello,
    RendezvousClient,
    RendezvousRefused,
    RendezvousServer,
    admit,
    store_key,
)

RUN = "run_0123456789abcdef01234567"
SECRET = "per-run-secret-minted-by-the-scheduler"
KEY = store_key(SECRET, RUN)


@pytest.fixture
def server():
    s = RendezvousServer("127.0.0.1", 0, RUN, KEY)
    node0 = RendezvousClient(s.address, KEY, RUN, node_rank=0, epoch=1, timeout_s=5)
    node0.set("pretrain:lighthouse", "http://10.0.0.1:29510")
    node0.set("ladder", '{"mixture": "a"}')
    node0.add("pretrain:joined", 1)
    yield s
    node0.close()
    s.close()


def _raw(server: RendezvousServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=5)


def test_tcpstore_answers_anyone() -> None:
    """The defect: any process that reaches a TCPStore reads and overwrites the run's keys."""
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    master.set("ladder", "node 0's decision")
    stranger = TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=5))
    assert stranger.get("ladder") == b"node 0's decision"
    stranger.set("ladder", "the attacker's")
    assert master.get("ladder") == b"the attacker's"


def test_a_stranger_reads_nothing(server: RendezvousServer) -> None:
    """Speaking TCPStore's protocol, or anything else, yields the nonce and then a closed socket."""
    stranger = TCPStore  # the tool an attacker reaches for first
    with pytest.raises(Exception):
        stranger("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=2)).get("ladder")
    sock = _raw(server)
    sock.sendall(b"\x00" * 64 + b"ladder")
    got = read_until_closed(sock)
    assert (
        got.startswith(rs.MAGIC) and len(got) == len(rs.MAGIC) + sealed.NONCE_BYTES
    )  # the nonce, nothing else
    assert b"10.0.0.1" not in got and b"mixture" not in got


def test_another_runs_key_or_id_opens_nothing(server: RendezvousServer) -> None:
    other_run = "run_ffffffffffffffffffffffff"
    for key, run in ((store_key(SECRET, other_run), other_run), (store_key("another secret", RUN), RUN)):
        with pytest.raises(RendezvousRefused):
            RendezvousClient(server.address, key, run, node_rank=1, epoch=1, timeout_s=2)
    # the right key under another run id (a node of another run presenting its own id) is refused too
    with pytest.raises(RendezvousRefused):
        RendezvousClient(server.address, KEY, other_run, node_rank=1, epoch=1, timeout_s=2)
    assert server.refused >= 3


def test_a_stranger_writes_nothing(server: RendezvousServer) -> None:
    """A forged or replayed frame after someone else's handshake cannot change a key: the node's
    channel ends instead, and the store keeps node 0's values."""
    node1 = RendezvousClient(server.address, KEY, RUN, node_rank=1, epoch=1, timeout_s=5)
    # an attacker who spliced bytes into node 1's connection: the frame fails its seal
    sealed.send_frame(node1._channel.sock, b"\x01" * 40)
    with pytest.raises((RendezvousRefused, OSError)):
        node1._call(rs.Op("get", "ladder"))
    assert server.data["ladder"] == b'{"mixture": "a"}'
    assert server.data["pretrain:joined"] == b"1"


def test_a_stale_lease_epoch_is_refused_and_fenced(server: RendezvousServer) -> None:
    new = RendezvousClient(server.address, KEY, RUN, node_rank=1, epoch=3, timeout_s=5)
    assert new.get("pretrain:lighthouse") == b"http://10.0.0.1:29510"
    with pytest.raises(RendezvousRefused):  # the holder whose lease epoch 2 was taken over
        RendezvousClient(server.address, KEY, RUN, node_rank=1, epoch=2, timeout_s=2)
    assert new.add("pretrain:joined", 1) == 2
    new.close()


def test_half_open_connections_stall_no_one(server: RendezvousServer) -> None:
    """MAX_PENDING connections that never finish their handshake: a node of the run still connects
    at once and works while they hang, and the server closes them at the handshake bound."""
    hanging = [_raw(server) for _ in range(rs.MAX_PENDING - 1)]
    started = time.monotonic()
    node1 = RendezvousClient(server.address, KEY, RUN, node_rank=1, epoch=1, timeout_s=10)
    assert node1.add("pretrain:joined", 1) == 2
    assert time.monotonic() - started < rs.HANDSHAKE_TIMEOUT_S  # not made to wait for the flood
    for sock in hanging:
        got = read_until_closed(sock)  # the nonce, then closed by the server
        assert got.startswith(rs.MAGIC) and len(got) == len(rs.MAGIC) + sealed.NONCE_BYTES
        sock.close()
    node1.close()


def test_a_flood_past_the_limit_delays_a_node_by_the_bound_at_most(server: RendezvousServer) -> None:
    """Past MAX_PENDING the server closes new connections at once; a node arriving then retries
    and is in as soon as the flood's handshakes time out."""
    hanging = [_raw(server) for _ in range(rs.MAX_PENDING + 8)]
    time.sleep(0.3)  # every one accepted (or closed) before the node arrives
    node1 = RendezvousClient(
        server.address, KEY, RUN, node_rank=1, epoch=1, timeout_s=4 * rs.HANDSHAKE_TIMEOUT_S
    )
    assert node1.add("pretrain:joined", 1) == 2
    for sock in hanging:
        sock.close()
    node1.close()


def test_an_impostor_node0_is_not_believed() -> None:
    """A process that took node 0's port without the run's key cannot prove it: the client refuses
    before sending a single key or value."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def impostor() -> None:
        conn, _ = listener.accept()
        conn.sendall(rs.MAGIC + b"\x00" * sealed.NONCE_BYTES)
        sealed.recv_frame(conn, 4096), sealed.recv_frame(conn, 4096)
        sealed.send_frame(conn, b"\x00" * 32)
        conn.close()

    threading.Thread(target=impostor, daemon=True).start()
    with pytest.raises(RendezvousRefused):
        RendezvousClient(f"127.0.0.1:{port}", KEY, RUN, node_rank=1, epoch=1, timeout_s=2)
    listener.close()


@pytest.mark.parametrize(
    ("hello", "epochs", "why"),
    [
        (Hello(RUN, 1, 1, b""), {}, None),
        (Hello(RUN, 1, 1, b""), {1: 1}, None),  # the same holder reconnecting
        (Hello(RUN, 1, 2, b""), {1: 1}, None),  # the lease's new holder
        (Hello(RUN, 1, 0, b""), {1: 1}, "a stale lease epoch"),
        (Hello(RUN, 2, 0, b""), {1: 5}, None),  # epochs are per node rank
        (Hello("run_other", 1, 1, b""), {}, "another run"),
    ],
)
def test_admit(hello: Hello, epochs: dict[int, int], why: str | None) -> None:
    assert admit(hello, RUN, epochs) == why


def test_the_store_key_binds_the_run() -> None:
    assert store_key(SECRET, RUN) != store_key(SECRET, "run_other")
    assert (
        store_key(SECRET, RUN)
        == hmac.new(SECRET.encode(), b"ito-rdzv-store|" + RUN.encode(), hashlib.sha256).digest()
    )
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(Hello(RUN, 1, 2, b"n")), type=Hello).epoch == 2
