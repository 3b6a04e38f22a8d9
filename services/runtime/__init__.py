"""Shared runtime for the services and the operator CLI: settings, connections, the envelope
codec, Redis key layout, accounts and embedded infra. It is not a service and holds no policy."""
