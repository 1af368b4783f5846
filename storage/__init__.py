"""Artifact storage: versioned, immutable, content-addressed artifacts and their Parquet shards on any fsspec URL."""
