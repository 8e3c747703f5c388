"""Traces: the versioned schema (one SampleTrace row per sampled token), the streaming Parquet writer and the
reader. What a run records beside them (its manifest, its requests) is toolkit.runs.manifest."""
