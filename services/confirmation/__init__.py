"""Single-use confirmations: capabilities held server-side, referenced by an opaque ref."""
