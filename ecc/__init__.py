"""`ecc`: the client for managed training on booked Itô compute.

It must start fast: `--help` imports neither NATS nor msgspec, and nothing here imports torch or
faststream. Each verb imports only what it needs.
"""
