"""The nodes' rendezvous store, reachable only by the run's own nodes.

torch's TCPStore answers anyone who can reach its port: a process on a trainer host could read a
run's keys, overwrite node 0's ladder decision or bump the `joined` / `done` counters the nodes meet
on. This store keeps the same few operations (`set`, `get` waiting for the key, `add`, `check`) and
admits a connection only after a mutual challenge-response on the run's rendezvous key (the sealed
channel, runtime/security/sealed.py, which a replica group's healing transfers speak too):

- the scheduler mints a random key per run (`TrainWork.rendezvous_key`, inside the signed work
  item; never logged, never in an event or answer); both ends derive the run's store key from it
  and the run id (`store_key`), so another run's key opens nothing;
- the server sends a nonce; the client answers with its hello (run id, node rank, lease epoch, its
  own nonce) and an HMAC-SHA256 over the server's nonce and the hello; the server answers with an
  HMAC of its own over both nonces (the client knows it reached node 0 of its run, not an
  impostor); a wrong tag, another run id, or an epoch lower than one this node rank already
  presented (a fenced lease holder) is dropped without a byte of the store;
- after it, every frame is sealed with AES-GCM under a session key derived from both nonces (a
  counter nonce per direction), so a replayed, reordered or altered frame ends the connection;
- a connection that does not finish the handshake within HANDSHAKE_TIMEOUT_S is closed, and at
  most MAX_PENDING connections may be in their handshake at once; every connection has a thread of
  its own, so a flood of half-open ones stalls no node already connected, and a node that arrives
  while the flood fills every slot is closed at once and retries until its own bound (the slots
  free within HANDSHAKE_TIMEOUT_S).

Decisions that can be tested as tables live in pure functions (`store_key`, `client_tag`,
`server_tag`, `admit`); the sockets are tested against attacking clients in
tests/security/test_rendezvous_attacks.py.
"""

import hashlib
import hmac
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import msgspec

from runtime.security import sealed
from runtime.security.sealed import HANDSHAKE_TIMEOUT_S, Channel, Hello

MAGIC: Final = b"ITO-RDZV1"
MAX_FRAME: Final = 1 << 20  # a ladder decision is a few KB; anything near this is not ours
MAX_PENDING: Final = 128  # half-open handshakes at once; past it a connection is closed at once
POLL_S: Final = 0.05
__all__ = ["HANDSHAKE_TIMEOUT_S", "Hello", "RendezvousClient", "RendezvousRefused", "RendezvousServer"]

RendezvousRefused = sealed.Refused  # the other end is not this run's (or the connection ended)


class Op(msgspec.Struct, frozen=True):
    op: str  # "set", "get", "add", "check"
    key: str
    value: bytes = b""
    amount: int = 0


class Reply(msgspec.Struct, frozen=True):
    found: bool
    value: bytes = b""
    number: int = 0


def store_key(rendezvous_key: str, run_id: str) -> bytes:
    """The run's store key: the scheduler's per-run secret bound to the run id (the same secret
    under another run id opens nothing)."""
    return hmac.new(rendezvous_key.encode(), b"ito-rdzv-store|" + run_id.encode(), hashlib.sha256).digest()


admit = sealed.admit  # another run's id, or a stale lease epoch: the one rule (runtime/security/sealed.py)


@dataclass
class RendezvousServer:
    """Node 0's store. `address` is where it listens; `close` stops it and ends every connection."""

    host: str
    port: int
    run_id: str
    key: bytes
    data: dict[str, bytes] = field(default_factory=dict)
    epochs: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._lock = threading.Condition()
        self._sessions: dict[int, list[socket.socket]] = {}
        self._listener = sealed.Listener(self.host, self.port, self._serve, MAX_PENDING, "rdzv")
        self.port = self._listener.port

    @property
    def refused(self) -> int:
        """Connections dropped at the handshake, or before it when every slot was taken."""
        return self._listener.refused

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for socks in self._sessions.values():
                for s in socks:
                    sealed.quietly_close(s)
            self._sessions.clear()

    def _handshake(self, conn: socket.socket) -> tuple[Channel, Hello]:
        def admitted(hello: Hello) -> str | None:
            with self._lock:
                why = admit(hello, self.run_id, self.epochs)
                if why is not None:
                    return why
                if hello.epoch > self.epochs.get(hello.node_rank, -1):
                    for old in self._sessions.pop(hello.node_rank, []):
                        sealed.quietly_close(old)  # the fenced holder's connections end now
                self.epochs[hello.node_rank] = hello.epoch
                self._sessions.setdefault(hello.node_rank, []).append(conn)
            return None

        return sealed.server_handshake(conn, self.key, MAGIC, admitted, MAX_FRAME)

    def _serve(self, conn: socket.socket, handshake_done: Callable[[], None]) -> None:
        try:
            channel, _ = self._handshake(conn)  # a refusal is the listener's to count and close
        finally:
            handshake_done()
        try:
            while not self._listener.closed.is_set():
                op = channel.recv(Op)
                assert isinstance(op, Op)
                channel.send(self._apply(op))
        except sealed.REFUSALS:
            pass
        finally:
            sealed.quietly_close(conn)

    def _apply(self, op: Op) -> Reply:
        with self._lock:
            if op.op == "set":
                self.data[op.key] = op.value
                self._lock.notify_all()
                return Reply(found=True)
            if op.op == "add":
                number = int(self.data.get(op.key, b"0")) + op.amount
                self.data[op.key] = str(number).encode()
                return Reply(found=True, number=number)
            value = self.data.get(op.key)
            return Reply(found=value is not None, value=value or b"")


class RendezvousClient:
    """A node's connection to node 0's store (node 0 connects to its own too): TCPStore's `set`,
    `get` (waits for the key, up to `timeout_s`), `add` and `check`, over the sealed channel."""

    def __init__(
        self, endpoint: str, key: bytes, run_id: str, node_rank: int, epoch: int, timeout_s: float
    ) -> None:
        host, _, port = endpoint.rpartition(":")
        self.timeout_s = timeout_s
        deadline = time.monotonic() + timeout_s
        while True:  # node 0 may not listen yet, or be full of half-open handshakes: retry to the bound
            try:
                sock = socket.create_connection((host.strip("[]"), int(port)), timeout=HANDSHAKE_TIMEOUT_S)
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
                continue
            try:
                hello = sealed.hello(run_id, node_rank, epoch)
                self._channel = sealed.client_handshake(sock, key, MAGIC, hello, MAX_FRAME)
                break
            except sealed.NoNonce:
                sealed.quietly_close(sock)  # closed before the nonce: no slot free yet, not a refusal
                if time.monotonic() > deadline:
                    raise RendezvousRefused("node 0's store took no connection in time") from None
                time.sleep(0.2)
            except (OSError, struct.error) as exc:
                sealed.quietly_close(sock)
                raise RendezvousRefused("node 0's store did not finish the handshake") from exc
            except RendezvousRefused:
                sealed.quietly_close(sock)
                raise
        self._lock = threading.Lock()

    def _call(self, op: Op) -> Reply:
        with self._lock:
            self._channel.send(op)
            reply = self._channel.recv(Reply)
        assert isinstance(reply, Reply)
        return reply

    def set(self, key: str, value: str | bytes) -> None:
        self._call(Op("set", key, value.encode() if isinstance(value, str) else value))

    def add(self, key: str, amount: int) -> int:
        return self._call(Op("add", key, amount=amount)).number

    def check(self, keys: list[str]) -> bool:
        return all(self._call(Op("get", k)).found for k in keys)

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + self.timeout_s
        while True:
            reply = self._call(Op("get", key))
            if reply.found:
                return reply.value
            if time.monotonic() > deadline:
                raise TimeoutError(f"rendezvous key {key!r} not set within {self.timeout_s:g} s")
            time.sleep(POLL_S)

    def close(self) -> None:
        sealed.quietly_close(self._channel.sock)
