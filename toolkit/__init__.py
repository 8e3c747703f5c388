"""toolkit: a traced, replayable cached-decode engine for LLM decoding research.

    from toolkit import replay, verify
    report = replay("traces/2026-11-22/10-00-00-run", overrides=["engine.max_num_batched_tokens=8"])
    print(report.summary_line())
"""

from toolkit.version import __version__

__all__ = ["__version__", "replay", "verify"]


def replay(run_dir, overrides=(), **kwargs):
    """Re-run a recorded run directory and compare every sample row bit for bit (see toolkit.audit.replay)."""
    from toolkit.audit.replay import replay as _replay

    return _replay(run_dir, overrides, **kwargs)


def verify(run_dir, **kwargs):
    """Teacher-forced recomputation of a recorded run (see toolkit.audit.verify)."""
    from toolkit.audit.verify import verify as _verify

    return _verify(run_dir, **kwargs)
