"""The scheduler: the canonical API and the only owner of workload creation."""
