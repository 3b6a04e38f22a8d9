"""The base every contract Struct derives from: frozen, strict, keyword-only."""

import msgspec


class Contract(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A wire message. Unknown fields are rejected so that a typo never passes silently."""
