"""The answer every API call returns, to the CLI and from the CLI to its user."""

from typing import Generic, TypeVar

import msgspec

from contracts.errors import ApiError

T = TypeVar("T")


# our answer: readers skip newer fields
class Envelope(msgspec.Struct, Generic[T], frozen=True, kw_only=True, omit_defaults=True):
    """`{ok, live_api_contacted, notice, data | error}`: `notice` is always present (null when
    there is nothing to say); exactly one of `data` and `error` is on the wire. `Envelope[RunView]`
    decodes `data` as a RunView in the same pass (contracts/endpoints.py names each answer's type);
    a bare `Envelope` leaves it as plain JSON values."""

    ok: bool
    live_api_contacted: bool
    notice: str | None  # required, so that it is always on the wire (null when nothing to say)
    data: T | None = None
    error: ApiError | None = None

    def __post_init__(self) -> None:
        assert (self.error is None) == self.ok, "an ok envelope has no error; a failed one has one"
