"""The torch fallback: with no working compiler, or with TOOLKIT_NATIVE=0, the engine starts, says so once and
records it; kernel limits are checked when the backend is chosen. The engine, oracle and replay tests themselves
pass on the fallback in `make test-fallback` (every test whose path TOOLKIT_NATIVE=0 changes, tests/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import make_engine
from toolkit.errors import ConfigError
from toolkit.paths import cache_root
from toolkit.sampling.params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
WARNING = "toolkit: warning: native CPU kernels unavailable"

# two engines in one process, each generating: the second must not try the compiler again
TWO_ENGINES = """
import json, sys
from toolkit.config import EngineConfig, ModelConfig
from toolkit.sampling.params import SamplingParams
from toolkit.engine.core import Engine
from toolkit.models import load_model
from toolkit.runs.manifest import native_kernels
loaded = load_model(ModelConfig(name="tiny", seed=0))
out = []
for _ in range(2):
    engine = Engine(loaded, EngineConfig(), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    res = engine.generate([{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10]}])
    out.append({"attention": engine.attention_backend, "matmul": engine.matmul_backend,
                "tokens": [r.output_token_ids for r in res], **native_kernels(engine)})
print(json.dumps(out))
"""


def _run(env_extra: dict[str, str], code: str = TWO_ENGINES) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_extra}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.native
def test_a_failing_compiler_is_tried_once_warned_once_and_recorded(tmp_path):
    calls = tmp_path / "calls"
    fake = tmp_path / "fakecc"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\necho 'fakecc: error: no such compiler' >&2\nexit 1\n")
    fake.chmod(0o755)
    cache = tmp_path / "cache"  # no kernels built yet; the de-quantised model (the tokenizer) linked, not rebuilt
    cache.mkdir()
    for entry in cache_root().glob("*"):
        if entry.name != "kernels":
            (cache / entry.name).symlink_to(entry)
    result = _run(
        {"CC": str(fake), "TOOLKIT_CACHE": str(cache), "TOOLKIT_KERNEL_TARGET": "", "TOOLKIT_NATIVE": "1"}
    )  # the switch on, even in a suite run with TOOLKIT_NATIVE=0
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if line.startswith(WARNING)]
    assert len(warnings) == 1, result.stderr
    assert "fakecc" in warnings[0] and "Fix: install gcc or clang" in warnings[0]
    runs = json.loads(result.stdout.strip().splitlines()[-1])
    assert [(r["attention"], r["matmul"]) for r in runs] == [("sdpa", "torch")] * 2
    assert runs[0]["tokens"] == runs[1]["tokens"]
    assert runs[0]["native_kernels"].startswith("not used (unavailable:") and runs[0]["kernel_numerics"] is None
    sources = len(list((ROOT / "toolkit" / "native" / "csrc").glob("*.c")))
    invocations = calls.read_text().splitlines()
    # one --version, then each source with and without OpenMP: once per process, not once per use
    assert len(invocations) <= 1 + 2 * sources, invocations


def test_native_off_switch_is_quiet_and_recorded():
    result = _run({"TOOLKIT_NATIVE": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert WARNING not in result.stderr
    runs = json.loads(result.stdout.strip().splitlines()[-1])
    assert (runs[0]["attention"], runs[0]["matmul"]) == ("sdpa", "torch")
    assert "TOOLKIT_NATIVE=0" in runs[0]["native_kernels"]


def test_batch_invariant_without_kernels_is_one_line_naming_the_cause(tiny, monkeypatch):
    monkeypatch.setenv("TOOLKIT_NATIVE", "0")
    with pytest.raises(ConfigError) as err:
        make_engine(tiny, batch_invariant=True)
    message = str(err.value)
    assert "\n" not in message and "batch_invariant=true is unavailable here" in message and "TOOLKIT_NATIVE" in message


@pytest.mark.native
def test_kernel_limits_are_checked_when_the_backend_is_chosen(tiny, monkeypatch):
    """A block size past the kernel's limit: auto takes the torch path and generates; asking for the kernel
    is a one-line error at construction, never an exception at the first forward. (The limits are the built
    kernel's: the switch is on here even in a suite run with TOOLKIT_NATIVE=0.)"""
    monkeypatch.setenv("TOOLKIT_NATIVE", "1")
    engine = make_engine(tiny, block_size=128, num_kv_blocks=16)
    assert engine.attention_backend == "sdpa"
    out = engine.generate(
        [
            {
                "prompt_token_ids": list(range(3, 30)),
                "sampling_params": SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
            }
        ]
    )
    assert len(out[0].output_token_ids) == 3
    with pytest.raises(ConfigError, match="attention_backend=kernel is unavailable: .*block_size 128"):
        make_engine(tiny, block_size=128, num_kv_blocks=16, attention_backend="kernel")
