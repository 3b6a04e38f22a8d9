"""The client's default timeouts: the one place for each value.

`ecc.main` builds its `--connect-timeout` and `--timeout` defaults (and their help) from here, and
`ecc.transport` uses them as the `Client`'s defaults. This module imports nothing, so `--help`
stays free of NATS and msgspec.
"""

DEFAULT_CONNECT_TIMEOUT_S = 2.0  # a local or LAN server answers in milliseconds; raise it on a slow VPN
RETRY_REFUSED_S = 0.1  # a node that refused the connection is tried once more after this
DEFAULT_TIMEOUT_S = 15.0  # covers eligibility, plan, confirmation and ledger hops on a busy server
