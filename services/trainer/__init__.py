"""The trainer: pulls runs from the JetStream work queue and trains them for real with torch."""
