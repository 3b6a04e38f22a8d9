"""A trained run's outputs: exports in the Hugging Face layout, downloads and samples, from committed checkpoints."""
