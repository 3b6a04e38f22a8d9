"""Security: accounts and credentials, every identity's permissions, the secrets directory, the scheduler's signatures, TLS, and per-tenant quotas."""
