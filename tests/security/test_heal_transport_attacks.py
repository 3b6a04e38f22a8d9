"""A replica group's healing transfers from a process that is not a group of the run (services/
trainer/engine/heal_transport.py): it reads no weight, serves no state, and stalls no transfer.
torchft's own HTTP transport, which the trainer used before, hands the whole state to anyone:
`test_torchfts_http_transport_serves_anyone` keeps that contrast on record."""

import io
import os
import pickle
import socket
import threading
import urllib.request
from datetime import timedelta

import pytest
import torch
from torchft.checkpointing.http_transport import HTTPTransport

from runtime.security import sealed
from tests.security.conftest import read_until_closed
from training.engine import heal_transport as ht
from training.engine.heal_transport import Seal, SealedTransport, heal_key

RUN = "run_0123456789abcdef01234567"
SECRET = "per-run-secret-minted-by-the-scheduler"
TIMEOUT = timedelta(seconds=5)
WEIGHT = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7.0


def _seal(replica_id: int, *, run_id: str = RUN, secret: str = SECRET, epoch: int = 1) -> Seal:
    return Seal(key=heal_key(secret, run_id), run_id=run_id, replica_id=replica_id, epoch=epoch)


def _state(step: int = 7) -> dict:
    return {
        "user": {
            "default": {
                "model": {"layer.weight": WEIGHT.clone()},
                "optim": {
                    "state": {0: {"step": torch.tensor(3.0), "exp_avg": WEIGHT * 2}},
                    "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0]}],
                },
                "scheduler": {"last_epoch": 3, "_last_lr": [0.1]},
            }
        },
        "torchft": {"step": step, "batches_committed": 2 * step},
    }


@pytest.fixture
def serving():
    """Replica 0 of the run, serving step 7's state to a group that heals."""
    server = SealedTransport(_seal(0), "127.0.0.1", TIMEOUT)
    server.send_checkpoint([1], 7, _state(), TIMEOUT)
    yield server
    server.shutdown()


def _client(**seal) -> SealedTransport:
    return SealedTransport(_seal(1, **seal), "127.0.0.1", TIMEOUT)


def test_torchfts_http_transport_serves_anyone() -> None:
    """The defect: whoever reaches the port reads the whole state (and a healing group would load
    whatever it is served with pickle)."""
    transport = HTTPTransport(timeout=TIMEOUT, num_chunks=0)
    try:
        transport.send_checkpoint([1], 7, _state(), TIMEOUT)
        port = transport.metadata().rsplit(":", 1)[1].split("/")[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/checkpoint/7/full", timeout=5) as answer:
            stolen = answer.read()
        assert WEIGHT.numpy().tobytes()[:16] in stolen
    finally:
        transport.shutdown()


def test_a_group_of_the_run_heals_from_its_peer(serving: SealedTransport) -> None:
    client = _client()
    try:
        state = client.recv_checkpoint(0, serving.metadata(), 7, TIMEOUT)
    finally:
        client.shutdown()
    assert torch.equal(state["user"]["default"]["model"]["layer.weight"], WEIGHT)
    assert state["user"]["default"]["optim"]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert state["torchft"] == {"step": 7, "batches_committed": 14}


def test_a_stranger_reads_nothing(serving: SealedTransport) -> None:
    """An HTTP GET, torchft's own request, or any bytes: the magic and a nonce, then a closed socket."""
    with pytest.raises(Exception):
        urllib.request.urlopen(f"http://{serving.metadata()}/checkpoint/7/full", timeout=5).read()
    sock = socket.create_connection(("127.0.0.1", serving.port), timeout=5)
    sock.sendall(b"GET /checkpoint/7/full HTTP/1.1\r\n\r\n" + b"\x00" * 64)
    got = read_until_closed(sock)
    assert got.startswith(ht.MAGIC) and len(got) == len(ht.MAGIC) + sealed.NONCE_BYTES
    assert WEIGHT.numpy().tobytes()[:16] not in got


@pytest.mark.parametrize(
    "other",
    [{"secret": "another-runs-secret"}, {"run_id": "run_another"}],
    ids=["another runs key", "this key under another run id"],
)
def test_another_runs_key_or_id_opens_nothing(serving: SealedTransport, other: dict) -> None:
    client = _client(**other)
    try:
        with pytest.raises(sealed.Refused):
            client.recv_checkpoint(0, serving.metadata(), 7, TIMEOUT)
    finally:
        client.shutdown()
    assert serving.refused >= 1


def test_a_stale_lease_epoch_is_refused(serving: SealedTransport) -> None:
    fresh, stale = _client(epoch=2), _client(epoch=1)
    try:
        fresh.recv_checkpoint(0, serving.metadata(), 7, TIMEOUT)
        with pytest.raises(sealed.Refused):
            stale.recv_checkpoint(0, serving.metadata(), 7, TIMEOUT)
    finally:
        fresh.shutdown()
        stale.shutdown()


def test_only_the_step_served_now_is_served(serving: SealedTransport) -> None:
    client = _client()
    try:
        with pytest.raises(sealed.Refused, match="does not serve step 6"):
            client.recv_checkpoint(0, serving.metadata(), 6, TIMEOUT)
        serving.disallow_checkpoint()  # the group stepped on: its state may change, nothing is served
        with pytest.raises((sealed.Refused, TimeoutError)):  # waits for a step, to the bound at most
            client.recv_checkpoint(0, serving.metadata(), 7, timedelta(seconds=1))
        serving.send_checkpoint([1], 8, _state(8), TIMEOUT)  # the next heal is served again
        assert client.recv_checkpoint(0, serving.metadata(), 8, TIMEOUT)["torchft"]["step"] == 8
    finally:
        client.shutdown()


def test_an_impostor_server_is_not_believed_and_nothing_is_loaded() -> None:
    """A process that answers at the quorum's address without the key (say, it joined the Lighthouse
    as a replica ahead of the others): the group refuses it before reading a byte of state."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def impostor() -> None:
        conn, _ = listener.accept()
        conn.sendall(ht.MAGIC + os.urandom(sealed.NONCE_BYTES))
        sealed.recv_frame(conn, 4096), sealed.recv_frame(conn, 4096)
        sealed.send_frame(conn, os.urandom(32))  # it cannot make the server's tag
        conn.close()

    threading.Thread(target=impostor, daemon=True).start()
    client = _client()
    try:
        with pytest.raises(sealed.Refused, match="did not prove"):
            client.recv_checkpoint(0, f"127.0.0.1:{port}", 7, TIMEOUT)
    finally:
        client.shutdown()
        listener.close()


class _Planted:
    def __reduce__(self):
        return (os.system, ("echo planted > /dev/null",))


def test_even_a_key_holder_cannot_make_a_group_run_code(serving: SealedTransport) -> None:
    """Defence in depth: a state that is a pickle of code (a compromised peer of the run) is refused
    by the receiving group's `weights_only` load."""
    buffer = io.BytesIO()
    torch.save({"user": _Planted()}, buffer, pickle_module=pickle)
    with serving._served:
        serving._payload = buffer.getvalue()
    client = _client()
    try:
        with pytest.raises(pickle.UnpicklingError):
            client.recv_checkpoint(0, serving.metadata(), 7, TIMEOUT)
    finally:
        client.shutdown()


def test_half_open_connections_stall_no_transfer(serving: SealedTransport) -> None:
    idle = [socket.create_connection(("127.0.0.1", serving.port), timeout=5) for _ in range(20)]
    client = _client()
    try:
        state = client.recv_checkpoint(0, serving.metadata(), 7, TIMEOUT)
        assert torch.equal(state["user"]["default"]["model"]["layer.weight"], WEIGHT)
    finally:
        client.shutdown()
        for s in idle:
            s.close()


def test_the_seal_never_shows_its_key() -> None:
    seal = _seal(0)
    assert seal.key.hex() not in repr(seal) and str(seal.key) not in repr(seal)
    assert "key=<hidden>" in repr(seal)


def test_the_heal_key_binds_the_run_and_the_purpose() -> None:
    from training.launch.rendezvous import store_key

    assert heal_key(SECRET, RUN) == heal_key(SECRET, RUN)
    assert heal_key(SECRET, RUN) != heal_key(SECRET, "run_other")
    assert heal_key(SECRET, RUN) != heal_key("other", RUN)
    assert heal_key(SECRET, RUN) != store_key(SECRET, RUN)  # the store's key opens nothing here
