"""The idempotency ledger: caller-supplied keys reserved atomically with the run they create."""
