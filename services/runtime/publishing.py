"""One way to put a message on a JetStream stream: with its `Nats-Msg-Id`, bounded, awaited.

The stream drops a second message with the same id inside its duplicate window
(`streams.DUPLICATE_WINDOW_S`), so a publisher that retries after a lost PubAck never stores a
message twice. Every stream publish in the services goes through `publish_once`; the id is the
caller's, because only the caller knows what makes two messages "the same".
"""

from collections.abc import Mapping

from faststream.nats import NatsBroker

from services.runtime.settings import Settings

MSG_ID_HEADER = "Nats-Msg-Id"


def headers_for(msg_id: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The headers of a stream message: its dedup id, plus any (e.g. a work item's signature)."""
    if not msg_id:
        raise ValueError("a stream message needs a non-empty Nats-Msg-Id")
    return {MSG_ID_HEADER: msg_id, **(extra or {})}


async def publish_once(
    broker: NatsBroker,
    settings: Settings,
    *,
    subject: str,
    stream: str,
    body: bytes,
    msg_id: str,
    extra_headers: Mapping[str, str] | None = None,
) -> None:
    """Publish `body` to `subject` on `stream` (a logical name, namespaced here) and await the
    PubAck for at most the request timeout."""
    await broker.publish(
        body,
        subject,
        stream=settings.stream(stream),
        headers=headers_for(msg_id, extra_headers),
        timeout=settings.request_timeout_s,
    )
