"""toolkit: a traced, replayable cached-decode engine for LLM decoding research.

from toolkit import LLM, SamplingParams
llm = LLM(model="smollm2")
outputs = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32, seed=0))
print(outputs[0].outputs[0].text, llm.trace_dir)

from toolkit import replay, verify
report = replay("traces/2026-11-22/10-00-00-run", overrides=["engine.max_num_batched_tokens=8"])
print(report.summary_line())
"""

import importlib

from toolkit.version import __version__

__all__ = ["LLM", "SamplingParams", "__version__", "replay", "verify"]
_LAZY = {
    "LLM": "toolkit.llm",
    "SamplingParams": "toolkit.sampling.params",
}  # imported on first use: `import toolkit` stays light


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'toolkit' has no attribute {name!r}")


def replay(run_dir, overrides=(), **kwargs):
    """Re-run a recorded run directory and compare every sample row bit for bit (see toolkit.reproduce.replay)."""
    from toolkit.reproduce.replay import replay as _replay  # deferred: torch; `import toolkit` stays light

    return _replay(run_dir, overrides, **kwargs)


def verify(run_dir, **kwargs):
    """Teacher-forced recomputation of a recorded run (see toolkit.reproduce.verify)."""
    from toolkit.reproduce.verify import verify as _verify  # deferred: torch; `import toolkit` stays light

    return _verify(run_dir, **kwargs)
