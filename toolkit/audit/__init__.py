"""Auditing a recorded run: replay (bit-for-bit re-run) and verify (teacher-forced recomputation)."""
