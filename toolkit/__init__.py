"""toolkit: a traced, replayable cached-decode engine for LLM decoding research."""

__version__ = "0.1.0"
