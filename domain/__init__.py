"""Pure rules more than one service must apply the same way (what a manifest runs, where a run's
checkpoints live). No I/O here: each service calls them, none imports another service."""
