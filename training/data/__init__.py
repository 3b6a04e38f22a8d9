"""The trainer's data: corpora and batches, chat data, token files, the tokenizer, data preparation, rows of JSONL/Parquet."""
