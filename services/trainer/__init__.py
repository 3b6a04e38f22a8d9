"""The trainer service: pulls runs from the JetStream work queue and trains them with the torch
library in `training/`. Here: the app and the worker, a run's events, the meter, the storage check,
a follower node's decisions, and a trained run's outputs (exports, restore, samples)."""
