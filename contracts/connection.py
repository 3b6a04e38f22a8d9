"""The client's connection file: where the ito-training API is, as `ito-training up` writes it and
`ecc` reads it (ecc/connection.py says where the file lives and in what order it is consulted).

Lenient (`Internal`): our own tool writes it, and an older `ecc` must still read the file a newer
`up` wrote (an unknown field is skipped). No secret is ever in it: the credential stays in
credentials.json beside it.
"""

from contracts.base import Internal
from contracts.environment import DEFAULT_NAMESPACE


class Connection(Internal, frozen=True, kw_only=True):
    """How to reach one ito-training API."""

    url: str  # the NATS URL, or a cluster's comma-separated server pool
    namespace: str = DEFAULT_NAMESPACE  # the subjects' prefix the stack serves under (ITO_NAMESPACE)
    ca: str | None = None  # path of the CA certificate ecc verifies the server with (TLS); None: none
