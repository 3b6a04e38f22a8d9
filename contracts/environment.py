"""The environment variables the client (`ecc`) and the services both read, with their defaults.

Names only, no reading: `ecc` may import nothing but `contracts`, so the few names it shares with
the services live here, once; runtime/configuration/settings.py takes them over as its own
constants beside every other `ITO_*` name (tests/house/test_settings_home.py keeps it so).
"""

ENV_NATS_URL = "ITO_NATS_URL"  # the API's NATS server, or a cluster's comma-separated server pool
ENV_NAMESPACE = "ITO_NAMESPACE"  # the subjects' prefix the stack serves under
ENV_NATS_CA = "ITO_NATS_CA"  # the CA file that verifies the NATS server's TLS (docs/tls.md)

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"  # the embedded stack's (`ito-training up`) on loopback
DEFAULT_NAMESPACE = "ito"
