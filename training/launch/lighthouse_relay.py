"""A stage's Lighthouse behind the run's key: node 0's torchft Lighthouse listens on its loopback
only, and the other nodes reach it through a sealed relay (runtime/security/sealed.py).

torchft's Lighthouse (gRPC) has no authentication: whoever reaches its port can join a quorum as a
replica (and, ahead of the others' step, be the one the others heal from), or stall every quorum.
Here:

- node 0 starts the Lighthouse on 127.0.0.1 and a `Relay` on its routable address; the relay admits
  a connection only after the mutual challenge-response on the run's Lighthouse key (`relay_key`:
  the scheduler's per-run secret bound to the run id and to this purpose), from a node of the same
  run whose lease epoch is not older than one it presented before, and then carries its bytes, sealed
  with AES-GCM, to the Lighthouse and back;
- every other node starts an `Entry` on its own loopback, which its replica group (or the node's
  ranks) dials as the Lighthouse: each connection made to it is carried over a fresh sealed
  connection to node 0's relay, once the relay proved it holds the key.

Loopback is the boundary: a container or a pod has a network namespace of its own, so only the
trainer's own processes reach 127.0.0.1 there (compose and the Kubernetes manifests run each trainer
agent in its own). The replica groups' data plane (torchft's per-quorum store and the gloo
connections it dials) is not carried here: see docs/security.md.
"""

import hashlib
import hmac
import socket
import threading
from collections.abc import Callable
from typing import Final

from runtime.security import sealed
from runtime.security.sealed import Channel, Hello

MAGIC: Final = b"ITO-LHR1"
CHUNK: Final = 64 << 10  # raw bytes read at once and sealed as one frame
MAX_PENDING: Final = 64  # half-open handshakes at once
CONNECT_TIMEOUT_S: Final = 10.0


def relay_key(rendezvous_key: str, run_id: str) -> bytes:
    """The run's Lighthouse key: the per-run secret bound to the run id and to the Lighthouse (the
    store's and the healing transfers' keys are others)."""
    return hmac.new(rendezvous_key.encode(), b"ito-lighthouse|" + run_id.encode(), hashlib.sha256).digest()


def _raw_to_sealed(raw: socket.socket, channel: Channel) -> None:
    while data := raw.recv(CHUNK):
        channel.send_bytes(data)


def _sealed_to_raw(channel: Channel, raw: socket.socket) -> None:
    while True:
        raw.sendall(channel.recv_bytes())


def _carry(raw: socket.socket, channel: Channel) -> None:
    """Carry bytes both ways until either side ends; then end both."""

    def one_way(pump: Callable[..., None], *args: object) -> None:
        try:
            pump(*args)
        except sealed.REFUSALS:
            pass
        finally:
            sealed.quietly_close(raw)
            sealed.quietly_close(channel.sock)

    back = threading.Thread(target=one_way, args=(_sealed_to_raw, channel, raw), daemon=True)
    back.start()
    one_way(_raw_to_sealed, raw, channel)
    back.join()


class Relay:
    """Node 0's side: listens on `host` (routable) and carries each admitted connection to the
    Lighthouse at `target` (its loopback port)."""

    def __init__(self, host: str, target: int, key: bytes, run_id: str) -> None:
        self.target, self.key, self.run_id = target, key, run_id
        self._epochs: dict[int, int] = {}
        self._lock = threading.Lock()
        self._listener = sealed.Listener(host, 0, self.serve, MAX_PENDING, "lighthouse-relay")
        self.host, self.port = host, self._listener.port

    @property
    def refused(self) -> int:
        return self._listener.refused

    def close(self) -> None:
        self._listener.close()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _admitted(self, hello: Hello) -> str | None:
        with self._lock:
            return sealed.admit_and_record(hello, self.run_id, self._epochs)

    def serve(self, conn: socket.socket, handshake_done: Callable[[], None]) -> None:
        try:
            channel, _ = sealed.server_handshake(conn, self.key, MAGIC, self._admitted, CHUNK)
        finally:
            handshake_done()
        lighthouse = socket.create_connection(("127.0.0.1", self.target), timeout=CONNECT_TIMEOUT_S)
        lighthouse.settimeout(None)
        _carry(lighthouse, channel)


class Entry:
    """Another node's side: listens on this node's loopback; each connection its replica group makes
    is carried over a fresh sealed connection to node 0's relay at `relay`."""

    def __init__(self, relay: str, key: bytes, run_id: str, node_rank: int, epoch: int) -> None:
        host, _, port = relay.rpartition(":")
        self.relay = (host.strip("[]"), int(port))
        self.key, self.run_id, self.node_rank, self.epoch = key, run_id, node_rank, epoch
        self._listener = sealed.Listener("127.0.0.1", 0, self.serve, MAX_PENDING, "lighthouse-entry")
        self.port = self._listener.port

    def close(self) -> None:
        self._listener.close()

    @property
    def lighthouse(self) -> str:
        """What this node's replica group dials as its Lighthouse."""
        return f"http://127.0.0.1:{self.port}"

    def serve(self, conn: socket.socket, handshake_done: Callable[[], None]) -> None:
        handshake_done()  # a local connection has no handshake of its own
        upstream = socket.create_connection(self.relay, timeout=CONNECT_TIMEOUT_S)
        try:
            hello = sealed.hello(self.run_id, self.node_rank, self.epoch)
            channel = sealed.client_handshake(upstream, self.key, MAGIC, hello, CHUNK)
        except BaseException:
            sealed.quietly_close(upstream)
            raise
        conn.settimeout(None)
        _carry(conn, channel)
