"""Shared runtime for the services and the operator CLI, in four rooms: `messaging` (the Bus,
codec, connections, streams, app wiring, metrics), `security` (accounts, identities, secrets,
signatures, TLS, quotas), `configuration` (settings, Redis keys, liveness timers, fault points) and
`storage` (checkpoint paths and stores, data files, the model store). It is not a service and holds
no policy; the embedded development stack is `devstack/`, the chaos harness `chaos/`."""
