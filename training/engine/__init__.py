"""The training engine every recipe uses: the loop, parallelism, DCP checkpoints, torchft fault tolerance, reporting, loss spikes."""
