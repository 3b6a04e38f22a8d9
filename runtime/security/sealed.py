"""A sealed channel between two processes that hold the same per-run key: the mutual
challenge-response and the AES-GCM frames every trainer endpoint between nodes speaks (node 0's
rendezvous store, training/launch/rendezvous.py; a replica group's healing transfers,
training/engine/heal_transport.py).

- The server sends its protocol's magic and a nonce; the client answers with its hello (run id,
  node rank, lease epoch, its own nonce) and an HMAC-SHA256 over the server's nonce and the hello;
  the server answers with an HMAC of its own over both (the client knows it reached a holder of the
  key, not an impostor). A wrong tag, or a hello the server's `admit` refuses, gets no byte more.
- After it every frame is sealed with AES-GCM under a session key derived from both nonces, its
  nonce the direction and a counter: a replayed, reordered or altered frame ends the connection.
- Each protocol has its own magic and derives its own key from the run's secret, so a client of one
  is never taken for a client of the other.

Pure parts (`client_tag`, `server_tag`, `session_key`) are tested as tables; the sockets against
attacking clients in tests/security/.
"""

import hashlib
import hmac
import os
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import msgspec
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

NONCE_BYTES: Final = 16
HANDSHAKE_TIMEOUT_S: Final = 3.0


class Refused(Exception):
    """The other end is not this run's: the handshake failed, a frame failed its seal, or the
    connection ended."""


class NoNonce(Exception):
    """The server closed before its nonce (say, every handshake slot was taken): try again."""


class Hello(msgspec.Struct, frozen=True):
    run_id: str
    node_rank: int
    epoch: int
    nonce: bytes


def admit(hello: Hello, run_id: str, epochs: dict[int, int]) -> str | None:
    """Why a hello whose tag checked out is still refused (None: admitted): another run's id, or a
    lease epoch lower than one this node rank already presented (its lease was taken over)."""
    if hello.run_id != run_id:
        return "another run"
    if hello.epoch < epochs.get(hello.node_rank, hello.epoch):
        return "a stale lease epoch"
    return None


def admit_and_record(hello: Hello, run_id: str, epochs: dict[int, int]) -> str | None:
    """`admit`, and an admitted hello's epoch recorded as its node rank's newest (the caller holds
    the lock that guards `epochs`)."""
    why = admit(hello, run_id, epochs)
    if why is None:
        epochs[hello.node_rank] = max(hello.epoch, epochs.get(hello.node_rank, -1))
    return why


def client_tag(key: bytes, server_nonce: bytes, hello: bytes) -> bytes:
    return hmac.new(key, b"client|" + server_nonce + hello, hashlib.sha256).digest()


def server_tag(key: bytes, server_nonce: bytes, hello: bytes) -> bytes:
    return hmac.new(key, b"server|" + server_nonce + hello, hashlib.sha256).digest()


def session_key(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, b"session|" + server_nonce + client_nonce, hashlib.sha256).digest()


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack(">I", len(payload)) + payload)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(min(n - len(data), 1 << 20))
        if not chunk:
            raise Refused("the connection ended")
        data += chunk
    return bytes(data)


def recv_frame(sock: socket.socket, max_frame: int) -> bytes:
    (size,) = struct.unpack(">I", recv_exact(sock, 4))
    if size > max_frame:
        raise Refused("frame too large")
    return recv_exact(sock, size)


@dataclass
class Channel:
    """AES-GCM frames under the session key; the nonce is the direction and a counter."""

    sock: socket.socket
    aead: AESGCM
    send_dir: bytes
    recv_dir: bytes
    max_frame: int
    sent: int = 0
    received: int = 0

    def send_bytes(self, payload: bytes) -> None:
        nonce = self.send_dir + self.sent.to_bytes(11, "big")
        self.sent += 1
        send_frame(self.sock, self.aead.encrypt(nonce, payload, None))

    def recv_bytes(self) -> bytes:
        nonce = self.recv_dir + self.received.to_bytes(11, "big")
        self.received += 1
        sealed = recv_frame(self.sock, self.max_frame + 16)  # the GCM tag rides on each frame
        try:
            return self.aead.decrypt(nonce, sealed, None)
        except Exception as exc:  # InvalidTag: altered, replayed or reordered
            raise Refused("a frame failed its seal") from exc

    def send(self, obj: object) -> None:
        self.send_bytes(msgspec.msgpack.encode(obj))

    def recv(self, kind: type) -> object:
        return msgspec.msgpack.decode(self.recv_bytes(), type=kind)


def server_handshake(
    conn: socket.socket,
    key: bytes,
    magic: bytes,
    admit: Callable[[Hello], str | None],
    max_frame: int,
) -> tuple[Channel, Hello]:
    """The server's half: `admit` sees a hello whose tag checked out and says why it is still
    refused (None: admitted; it may record the hello). Refused, OSError or a decode error when
    the client is not the run's."""
    conn.settimeout(HANDSHAKE_TIMEOUT_S)
    nonce = os.urandom(NONCE_BYTES)
    conn.sendall(magic + nonce)
    raw = recv_frame(conn, 4096)
    tag = recv_frame(conn, 4096)
    if not hmac.compare_digest(tag, client_tag(key, nonce, raw)):
        raise Refused("wrong key")
    hello = msgspec.msgpack.decode(raw, type=Hello)
    why = admit(hello)
    if why is not None:
        raise Refused(why)
    send_frame(conn, server_tag(key, nonce, raw))
    conn.settimeout(None)
    aead = AESGCM(session_key(key, nonce, hello.nonce))
    return Channel(conn, aead, send_dir=b"s", recv_dir=b"c", max_frame=max_frame), hello


def client_handshake(sock: socket.socket, key: bytes, magic: bytes, hello: Hello, max_frame: int) -> Channel:
    """The client's half: NoNonce when the server closed before its nonce, Refused when it is not
    the run's (it does not prove it holds the key)."""
    try:
        head = recv_exact(sock, len(magic) + NONCE_BYTES)
    except (Refused, OSError) as exc:
        raise NoNonce() from exc
    if not head.startswith(magic):
        raise Refused("not this protocol's server")
    nonce = head[len(magic) :]
    raw = msgspec.msgpack.encode(hello)
    send_frame(sock, raw)
    send_frame(sock, client_tag(key, nonce, raw))
    if not hmac.compare_digest(recv_frame(sock, 4096), server_tag(key, nonce, raw)):
        raise Refused("the server did not prove it holds the run's key")
    sock.settimeout(None)
    aead = AESGCM(session_key(key, nonce, hello.nonce))
    return Channel(sock, aead, send_dir=b"c", recv_dir=b"s", max_frame=max_frame)


Serve = Callable[[socket.socket, Callable[[], None]], None]
REFUSALS = (Refused, NoNonce, OSError, msgspec.DecodeError, struct.error, ValueError)


class Listener:
    """An endpoint's accept loop: each connection is served by `serve(conn, handshake_done)` on a
    thread of its own, and at most `max_pending` may be in their handshake at once (`handshake_done`
    frees the slot); past it a connection is closed at once, so a flood of half-open connections
    stalls no one already in. A connection whose `serve` raises one of REFUSALS is closed and counted
    in `refused` (tests and logs read it)."""

    def __init__(self, host: str, port: int, serve: Serve, max_pending: int, name: str) -> None:
        self._sock = socket.create_server((host, port))
        self._sock.settimeout(0.2)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._serve, self._name = serve, name
        self._pending = threading.BoundedSemaphore(max_pending)
        self.closed = threading.Event()
        self.refused = 0
        threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True).start()

    def close(self) -> None:
        self.closed.set()
        self._sock.close()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._pending.acquire(blocking=False):
                self.refused += 1
                quietly_close(conn)
                continue
            threading.Thread(target=self._guarded, args=(conn,), name=self._name, daemon=True).start()

    def _guarded(self, conn: socket.socket) -> None:
        released = threading.Event()

        def handshake_done() -> None:
            if not released.is_set():
                released.set()
                self._pending.release()

        try:
            self._serve(conn, handshake_done)
        except REFUSALS:
            self.refused += 1
            quietly_close(conn)
        finally:
            handshake_done()


def hello(run_id: str, node_rank: int, epoch: int) -> Hello:
    return Hello(run_id, node_rank, epoch, os.urandom(NONCE_BYTES))


def quietly_close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
