"""Helpers for attacking a real stack: connections that record what the server refused.

A denied publish or subscribe raises nothing in nats-py: the server drops it and reports a
`permissions violation` to the connection's error callback. So every attack here asserts the
refusal through that callback (or an auth error at connect) AND that nothing changed."""

import asyncio

import pytest


class Watched:
    def __init__(self, nc, errors: list[str]) -> None:
        self.nc = nc
        self.errors = errors

    def denied(self, what: str) -> bool:
        return any("permissions violation" in e and what.lower() in e for e in self.errors)

    async def close(self) -> None:
        await self.nc.close()


def _collector(errors: list[str]):
    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    return on_error


@pytest.fixture
def as_identity():
    opened: list[Watched] = []

    async def connect(stack, identity: str) -> Watched:
        errors: list[str] = []
        nc = await stack.nats(identity, error_cb=_collector(errors), allow_reconnect=False)
        opened.append(Watched(nc, errors))
        return opened[-1]

    yield connect


@pytest.fixture
def as_tenant():
    async def connect(stack, account: str, api_key: str, **options) -> Watched:
        errors: list[str] = []
        nc = await stack.tenant(account, api_key, error_cb=_collector(errors), **options)
        return Watched(nc, errors)

    return connect


async def settle(w: Watched, seconds: float = 0.5) -> None:
    """Give the server time to report a violation (it comes asynchronously)."""
    await w.nc.flush(timeout=2)
    await asyncio.sleep(seconds)


def read_until_closed(sock) -> bytes:
    """Everything a sealed endpoint sends a stranger before it closes the connection (the
    handshake's bound and a little more)."""
    from runtime.security.sealed import HANDSHAKE_TIMEOUT_S

    sock.settimeout(HANDSHAKE_TIMEOUT_S + 2)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data
