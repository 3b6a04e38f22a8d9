"""The chaos harness (`make chaos`): fault scenarios on embedded infra (SIGKILL of trainers and schedulers, NATS and Redis restarts, a cluster's node loss) and their table."""
