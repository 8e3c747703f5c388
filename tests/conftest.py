"""Shared fixtures: models are loaded once per session (SmolLM2 from the fp32 cache)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import torch

# the Triton kernels (toolkit/native/invariant_gpu.py) run in Triton's interpreter where torch sees no GPU: set
# before Triton decorates them, at their module's import (which the toolkit imports below reach)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import Phase, settings  # noqa: E402

from toolkit.config import EngineConfig, ModelConfig  # noqa: E402
from toolkit.engine.core import Engine  # noqa: E402
from toolkit.models import load_model  # noqa: E402
from toolkit.native import library  # noqa: E402
from toolkit.sampling.params import SamplingParams  # noqa: E402

# make test runs the suite on one pytest-xdist worker per core: each worker's torch (and the native kernels, which
# take torch's thread count), and through OMP_NUM_THREADS the processes its tests start, get the cores / workers,
# so that the workers do not oversubscribe the machine; run alone, a test gets 2 threads
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if WORKERS:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // WORKERS)))
    os.environ.pop("PYTEST_ADDOPTS", None)  # a test's own pytest run (a planted test file) runs in one process
# Ray's own OOM killer (a node policy: kill a worker past 95% of the machine's memory) would count the other
# pytest worker's memory against the Ray tests' actors on this 24 GiB machine; the kernel's limit is the real one
os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
THREADS = int(os.environ.get("TOOLKIT_TEST_THREADS") or (os.environ["OMP_NUM_THREADS"] if WORKERS else 2))
torch.set_num_threads(THREADS)

# no "explain" phase: it traces every line of a failing example and, with models in the
# frames, can take gigabytes when a property fails
settings.register_profile(
    "ci",
    deadline=None,
    print_blob=True,
    derandomize=True,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
)
# HYPOTHESIS_PROFILE=random: CI's settings drawn at random (a bug hunt; hypothesis' own "default" profile would also
# impose its 200 ms deadline, which the tests with a model in them pass only in CI's profile)
settings.register_profile("random", settings.get_profile("ci"), derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# TOOLKIT_HYPOTHESIS_SCALE=10: every property draws 10x the examples its @settings names (a bug hunt before a stop,
# not CI: docs/testing.md); HYPOTHESIS_PROFILE=random beside it draws them at random instead of derandomized
SCALE = int(os.environ.get("TOOLKIT_HYPOTHESIS_SCALE") or 1)


@pytest.hookimpl(tryfirst=True)  # before `-m native` selects
def pytest_collection_modifyitems(items):
    """A test under `native_only` is marked `native` too (see native_only). Under TOOLKIT_HYPOTHESIS_SCALE, each
    property's settings (which override the profile's) scaled once."""
    for item in items:
        if native_only.mark in item.iter_markers("skipif"):
            item.add_marker(pytest.mark.native)
    if SCALE <= 1:
        return
    for test in {id(f): f for f in (getattr(item, "obj", None) for item in items)}.values():
        given = getattr(test, "_hypothesis_internal_use_settings", None)
        if given is not None:
            test._hypothesis_internal_use_settings = settings(given, max_examples=given.max_examples * SCALE)


@pytest.fixture(scope="session")
def tiny():
    """A 2-layer random-init Llama with SmolLM2's tokenizer."""
    return load_model(ModelConfig(name="tiny", seed=0))


@pytest.fixture(scope="session")
def tiny_small_vocab():
    """A tiny model whose vocabulary (64) matches no tokenizer: requests give token ids."""
    return load_model(ModelConfig(name="tiny", seed=1, vocab_size=64))


@pytest.fixture(scope="session")
def smollm2():
    return load_model(ModelConfig(name="smollm2"))


# TOOLKIT_NATIVE=0 (the documented switch) runs the suite on the torch fallback: a test of the kernels
# themselves, or of a mode only they give (engine.batch_invariant=true, attention_backend=kernel), skips then
# with this reason. With the switch on, a kernel that does not build fails those tests: it never skips them.
# `native_only` marks a test `native` too (pytest_collection_modifyitems), so make test-fallback lists its skip.
NATIVE_OFF = library.switched_off()
NATIVE_OFF_REASON = (
    "TOOLKIT_NATIVE=0 switches the native kernels off, and this test checks them or a mode only they give"
)
native_only = pytest.mark.skipif(NATIVE_OFF, reason=NATIVE_OFF_REASON)
# a slow test of what does not change with the kernels (Ray's sharding, an experiment's table): run once, in
# `make test`; the fallback run (TOOLKIT_NATIVE=0) skips it with this reason
ONCE_REASON = (
    "TOOLKIT_NATIVE=0: this test's subject does not depend on the native kernels and it is slow; it runs in make test"
)
once = pytest.mark.skipif(NATIVE_OFF, reason=ONCE_REASON)
# engine.batch_invariant=true where the kernels run (its bits), the default mode with the switch off
BATCH_INVARIANT_OVERRIDE = f"engine.batch_invariant={str(not NATIVE_OFF).lower()}"
# the attention backends an engine can be asked for here, the native kernel first
ATTENTION_BACKENDS = ("sdpa",) if NATIVE_OFF else ("kernel", "sdpa")


_ASKING_FIXTURES: set[int] = set()  # the FixtureDefs whose setup asked toolkit.native (a module's engine, ...)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    before = library.consulted()
    try:
        return (yield)
    finally:
        if library.consulted() > before:
            _ASKING_FIXTURES.add(id(fixturedef))


@pytest.fixture(autouse=True)
def _native_marker_is_honest(request, tmp_path_factory):
    """`make test-fallback` reruns only the tests marked `native`: those whose code path TOOLKIT_NATIVE=0 changes.
    A test is one of them when it, a fixture it uses (the engine a module shares, set up once) or a child
    process it starts asks toolkit.native whether the kernels are switched off, which every choice between a
    kernel and torch's fallback does, and is told the kernels are on. Unmarked, such a test fails
    here (with the switch on), so no test that the fallback changes can be left out of the fallback run. A test
    that sets TOOLKIT_NATIVE=0 itself (the GPU path's Triton kernels in the interpreter) runs alike in both runs:
    it needs no mark, and make test runs it once.
    TOOLKIT_NATIVE_REPORT=<file>: write each test's answer there instead (to mark a new test file)."""
    probe = tmp_path_factory.getbasetemp() / f"native-probe-{os.getpid()}"
    probe.unlink(missing_ok=True)
    os.environ["TOOLKIT_NATIVE_PROBE"] = str(probe)
    before = library.consulted()
    yield
    os.environ.pop("TOOLKIT_NATIVE_PROBE", None)
    fixtures = [defs[-1] for defs in request.node._fixtureinfo.name2fixturedefs.values() if defs]  # the ones used
    took = library.consulted() > before or probe.exists() or any(id(d) in _ASKING_FIXTURES for d in fixtures)
    report = os.environ.get("TOOLKIT_NATIVE_REPORT")
    if report:
        with open(report, "a") as f:
            f.write(f"{int(took)} {request.node.nodeid}\n")
    elif took and not NATIVE_OFF and request.node.get_closest_marker("native") is None:
        pytest.fail(
            f"{request.node.nodeid} takes a path that TOOLKIT_NATIVE=0 changes (it asked toolkit.native) "
            f"but is not marked `native`, so make test-fallback would leave it out: add "
            f"@pytest.mark.native (or the module's pytestmark)",
            pytrace=False,
        )


def _malloc_trim():
    """glibc's malloc_trim, or None: the engine raises malloc's trim threshold to 1 GB (toolkit.engine.backends), so
    the heap a test's engines leave free would stay in the worker's resident memory, test after test (a worker
    peaked at 12.8 GB on a 24 GB machine, with stopped servers' engines kept too; 8.3 GB now)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """What a test's engines left free goes back to the system (see _malloc_trim)."""
    if _TRIM is not None:
        _TRIM(0)


def make_engine(loaded, **engine_kwargs) -> Engine:
    sampling = engine_kwargs.pop("sampling", SamplingParams(temperature=0.0))
    return Engine(loaded, EngineConfig(**engine_kwargs), sampling)
