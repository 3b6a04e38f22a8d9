"""Desk telemetry: turns each run's events into goodput, badput, interruptions and checkpoint
bandwidth, and rolls them up per booking, region and GPU model on `desk.telemetry.>`."""
