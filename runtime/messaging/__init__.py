"""Messaging: the Bus port and its nats-py adapter, the envelope codec, authenticated connections, JetStream streams and headers, a service's app wiring and its Prometheus metrics."""
