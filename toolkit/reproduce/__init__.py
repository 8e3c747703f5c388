"""Our own runs, reproduced and checked: `replay` (re-run a trace and compare it bit for bit, naming the first
divergence), `verify` (teacher-forced recomputation: cached == recomputed logits), `compare` (many runs as one
dataset) and `shard` (a recomputation spread over Ray workers, shared with the audit of other engines'
transcripts in toolkit.audit)."""
