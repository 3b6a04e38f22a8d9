"""Storage the services share: checkpoint paths and stores (local or S3-compatible), data files (JSONL, Parquet) and the model store."""
