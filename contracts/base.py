"""The bases every contract Struct derives from: frozen and keyword-only.

Strict (`Contract`) where outsiders write the input: API requests, the manifest, upstream booking
events; an unknown field there is a typo or an attack and is refused. Lenient (`Internal`) for what
our own services send each other (events, work items, internal requests and answers): an unknown
field is skipped, so an older reader survives a newer writer during a rolling upgrade. Schema
evolution: new fields get defaults; never retype or reorder; a changed meaning is a new type.
"""

import msgspec


class Contract(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Input from outside: unknown fields are rejected so that a typo never passes silently."""


class Internal(msgspec.Struct, frozen=True, kw_only=True):
    """A message between our own services: unknown (newer) fields are skipped."""
