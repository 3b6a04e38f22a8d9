"""The answer every API call returns, to the CLI and from the CLI to its user."""

from typing import Any

import msgspec

from contracts.errors import ApiError


# our answer: readers skip newer fields
class Envelope(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """`{ok, live_api_contacted, notice, data | error}`: `notice` is always present (null when
    there is nothing to say); exactly one of `data` and `error` is on the wire."""

    ok: bool
    live_api_contacted: bool
    notice: str | None  # required, so that it is always on the wire (null when nothing to say)
    data: Any = None
    error: ApiError | None = None

    def __post_init__(self) -> None:
        assert (self.error is None) == self.ok, "an ok envelope has no error; a failed one has one"
