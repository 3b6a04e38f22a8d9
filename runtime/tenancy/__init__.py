"""Tenancy: the Redis stores of accounts (credentials, their state) and of per-tenant quotas."""
