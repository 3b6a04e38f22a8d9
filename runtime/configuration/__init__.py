"""Configuration: settings from the environment, the Redis key layout, the liveness timers and the named fault points."""
