"""A replica group's healing transfers behind the run's key: torchft's `CheckpointTransport` over the
sealed channel (runtime/security/sealed.py).

torchft's own `HTTPTransport` serves a group's whole state (the model's weights, the optimizer's
moments) to anyone who can reach its port, and a healing group loads what it fetches with
`torch.load(weights_only=False)`: whoever answers at the address the quorum names runs code in it.
Here:

- the server admits a connection only after the mutual challenge-response on the run's heal key
  (`heal_key`: the scheduler's per-run secret bound to the run id and to this purpose, so the
  rendezvous store's key opens nothing here and another run's opens nothing at all), from a client
  of the same run presenting a lease epoch no lower than one its replica already presented;
- the state travels as sealed AES-GCM frames (altered, replayed or reordered frames end it), and
  only the step the group serves now (`send_checkpoint` .. `disallow_checkpoint`) is served: a
  request for another step is answered "not served", a request while nothing is served waits for
  the bounded timeout;
- the receiving group proves the server holds the key before it reads a byte, and loads the state
  with `torch.load(weights_only=True)`: tensors, numbers, strings and containers, never code.

What travels is what torchft hands over (`Manager._manager_state_dict`: the user's state and the
Manager's step), serialized by `torch.save` on CPU; the metadata a peer finds in the quorum is this
server's `host:port`. The transfer's size is bounded by MAX_STATE_BYTES.
"""

import hashlib
import hmac
import io
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Final

import msgspec
import torch
from torch.utils._pytree import tree_map_only
from torchft.checkpointing.transport import CheckpointTransport

from runtime.security import sealed
from runtime.security.sealed import Hello

MAGIC: Final = b"ITO-HEAL1"
FRAME_BYTES: Final = 4 << 20  # the state is sent in frames of this size
MAX_STATE_BYTES: Final = 1 << 40  # a bound on what a receiver accepts (a 70B model's state is ~1.1 TB / node)
MAX_PENDING: Final = 64  # half-open handshakes at once


class Seal(msgspec.Struct, frozen=True, kw_only=True):
    """What binds a replica group's healing transfers to its run: the run's heal key (`heal_key`;
    never logged: it is left out of the repr), the run id, this group's replica id and lease epoch."""

    key: bytes
    run_id: str
    replica_id: int
    epoch: int

    def __repr__(self) -> str:
        return f"Seal(run_id={self.run_id!r}, replica_id={self.replica_id}, epoch={self.epoch}, key=<hidden>)"


def heal_key(rendezvous_key: str, run_id: str) -> bytes:
    """The run's heal key: the scheduler's per-run rendezvous secret bound to the run id and to the
    healing transfers (the store's key, bound to the same run, is another)."""
    return hmac.new(rendezvous_key.encode(), b"ito-heal|" + run_id.encode(), hashlib.sha256).digest()


class _Ask(msgspec.Struct, frozen=True):
    step: int


class _Head(msgspec.Struct, frozen=True):
    served: bool
    size: int = 0


class SealedTransport(CheckpointTransport[Any]):
    """torchft's healing transport, sealed with the run's key (see the module doc)."""

    def __init__(self, seal: Seal, host: str, timeout: timedelta) -> None:
        self.seal, self.timeout = seal, timeout
        self._served = threading.Condition()
        self._step: int | None = None  # the step served now; None: nothing is
        self._payload = b""
        self._epochs: dict[int, int] = {}
        self._listener = sealed.Listener(host, 0, self._serve, MAX_PENDING, "heal")
        self.host, self.port = host, self._listener.port

    @property
    def refused(self) -> int:
        """Connections dropped at the handshake, or before it when every slot was taken."""
        return self._listener.refused

    # --- torchft's CheckpointTransport

    def metadata(self) -> str:
        return f"{self.host}:{self.port}"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        buffer = io.BytesIO()
        torch.save(tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), state_dict), buffer)
        with self._served:
            self._payload, self._step = buffer.getvalue(), step
            self._served.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._served:
            self._step, self._payload = None, b""

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        host, _, port = metadata.rpartition(":")
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout.total_seconds())
        try:
            hello = sealed.hello(self.seal.run_id, self.seal.replica_id, self.seal.epoch)
            channel = sealed.client_handshake(sock, self.seal.key, MAGIC, hello, FRAME_BYTES)
            sock.settimeout(timeout.total_seconds())
            channel.send(_Ask(step))
            head = channel.recv(_Head)
            assert isinstance(head, _Head)
            if not head.served or not 0 < head.size <= MAX_STATE_BYTES:
                raise sealed.Refused(f"the peer does not serve step {step}")
            data = bytearray()
            while len(data) < head.size:
                data += channel.recv_bytes()
            if len(data) != head.size:
                raise sealed.Refused("the peer sent more than it announced")
        finally:
            sealed.quietly_close(sock)
        return torch.load(io.BytesIO(bytes(data)), weights_only=True)

    def shutdown(self, wait: bool = True) -> None:
        self._listener.close()
        with self._served:
            self._step, self._payload = None, b""
            self._served.notify_all()

    # --- the server

    def _admitted(self, hello: Hello) -> str | None:
        with self._served:
            return sealed.admit_and_record(hello, self.seal.run_id, self._epochs)

    def _serve(self, conn: socket.socket, handshake_done: Callable[[], None]) -> None:
        try:  # a refusal is the listener's to count and close
            channel, _ = sealed.server_handshake(conn, self.seal.key, MAGIC, self._admitted, 4096)
        finally:
            handshake_done()
        try:
            conn.settimeout(self.timeout.total_seconds())
            ask = channel.recv(_Ask)
            assert isinstance(ask, _Ask)
            payload = self._wait_for(ask.step)
            if payload is None:
                channel.send(_Head(served=False))
                return
            channel.send(_Head(served=True, size=len(payload)))
            view = memoryview(payload)
            for start in range(0, len(payload), FRAME_BYTES):
                channel.send_bytes(bytes(view[start : start + FRAME_BYTES]))
        except sealed.REFUSALS:
            pass
        finally:
            sealed.quietly_close(conn)

    def _wait_for(self, step: int) -> bytes | None:
        """The state of `step` once it is served (None: another step is served, or none within the
        timeout)."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        with self._served:
            while self._step is None and not self._listener.closed.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._served.wait(left)
            return self._payload if self._step == step else None
