"""Where toolkit keeps what it builds once: de-quantised models and compiled kernels (a leaf module)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$TOOLKIT_CACHE, default ~/.cache/toolkit."""
    return Path(os.environ.get("TOOLKIT_CACHE") or Path.home() / ".cache" / "toolkit")
