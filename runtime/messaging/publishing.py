"""A JetStream message's headers: its `Nats-Msg-Id`, given by the caller.

The stream drops a second message with the same id inside its duplicate window
(`streams.DUPLICATE_WINDOW_S`), so a publisher that retries after a lost PubAck never stores a
message twice. Every stream publish in the services goes through the one `Bus.publish_once`
(runtime/messaging/bus.py); the id is the caller's, because only the caller knows what makes two
messages "the same".
"""

from collections.abc import Mapping

MSG_ID_HEADER = "Nats-Msg-Id"


def headers_for(msg_id: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The headers of a stream message: its dedup id, plus any (e.g. a work item's signature)."""
    if not msg_id:
        raise ValueError("a stream message needs a non-empty Nats-Msg-Id")
    return {MSG_ID_HEADER: msg_id, **(extra or {})}
