"""Another build's matmul for some rows (toolkit/native/schedules.py, issue 60): every FMA build's matmul is the
same FMA chain per output, so the engine may run, say, the AVX2 build's at one row on an AVX-512 CPU. Its bits are
the engine's own build's, the choice is measured with the others and recorded, and only a chosen build's packing is
kept."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import make_engine, native_only
from tests.test_schedules import mixed_run
from toolkit.config import MATMUL_BUILD_SCHEDULES, EngineConfig
from toolkit.errors import ConfigError
from toolkit.native import cpu, library, schedules
from toolkit.native.ops import matmul_invariant, pack_weight
from toolkit.runs.manifest import native_kernels

pytestmark = native_only


def _other_fma_build() -> str:
    """A build this CPU runs whose matmul is FMA chains at another width than the process's own build: the AVX2
    build beside AVX-512, AVX2 at 4 lanes beside AVX2, ..."""
    own = library.native().profile
    if not own.fma:
        pytest.skip(f"the process's build ({own.target}) has no FMA: its matmul's bits are its own")
    for name in ("x86-64-v3", "x86-64-v3/4", "armv8-a/8"):
        target = name.partition("/")[0]
        if name != own.target and target in cpu.runnable_targets():
            try:
                other = library.build_named(name)
            except library.KernelUnavailable as exc:
                print(f"{name} does not build here: {exc}")
                continue
            if other.profile.fma and (other.panel, other.lanes) != (library.native().panel, library.native().lanes):
                return name
    pytest.skip(f"no other FMA build with other panels runs on this CPU ({own.target})")


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 20),
    k=st.integers(1, 300),
    n=st.integers(1, 700),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    schedule=st.integers(0, len(schedules.SCHEDULES) - 1),
    seed=st.integers(0, 2**16),
)
def test_another_fma_builds_matmul_gives_the_same_bits(rows, k, n, dtype, schedule, seed):
    """The other build's matmul, on the weight packed for its panels, in any schedule: the process's build's
    product bit for bit, in every format (fp32, and 16-bit weights widened)."""
    other = library.build_named(_other_fma_build())
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = torch.randn(k, n, generator=gen).to(dtype)
    want = matmul_invariant(x, pack_weight(w), schedule=0)
    assert torch.equal(matmul_invariant(x, pack_weight(w, other), other, schedule), want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_running_another_builds_matmul_gives_its_own_bits(dtype, tmp_path, monkeypatch):
    """A mixed run (prefill chunks, 1 to 3 decode rows a step: the fused layers and the LM head at every class of
    rows) with another build's matmul chosen for one row, for 2-4 rows, or for every class: every logits row is the
    process's own build's, bit for bit; the manifest names the build; only the chosen build's packing is kept."""
    from toolkit.config import ModelConfig
    from toolkit.models import load_model

    other = _other_fma_build()
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    tiny = load_model(ModelConfig(name="tiny", seed=0, dtype=dtype))
    want = mixed_run(make_engine(tiny, matmul_schedule="fixed", max_num_batched_tokens=24, max_num_seqs=3))
    for builds in ((other, "", ""), ("", other, ""), (other, other, other)):
        labels = [f"{b} {s}" if b else s for b, s in zip(builds, ("quads-nopf", "tiles", "pairs"))]
        monkeypatch.setattr(
            schedules,
            "measure",
            lambda *a, labels=labels, **k: {c: {s: 1.0} for c, s in zip(("1-1", "2-4", "5-16"), labels)},
        )
        for path in tmp_path.rglob("schedule-*.json"):
            path.unlink()
        tiny = load_model(ModelConfig(name="tiny", seed=0, dtype=dtype))
        engine = make_engine(tiny, matmul_schedule="auto", max_num_batched_tokens=24, max_num_seqs=3)
        assert engine.matmul_schedule.builds == builds
        assert f"1: quads-nopf{f' ({other})' if builds[0] else ''}," in native_kernels(engine)["matmul_schedule"]
        assert set(tiny.model._packed) == {"", other}  # measured, chosen, packed at load
        got = mixed_run(engine)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[key], want[key]) for key in want), builds


@pytest.mark.parametrize("other_ms", [2.0, 0.97])
def test_a_build_measured_and_not_chosen_is_not_kept(other_ms, tmp_path, monkeypatch):
    """Another build slower, or faster by less than OTHER_BUILD_MARGIN (not worth a second packing): the own
    build's matmul runs every class, and the other's packing, made to time it, is released."""
    other = _other_fma_build()
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    if other not in [b.profile.target for b in schedules.matmul_builds(library.native())]:
        monkeypatch.setattr(schedules, "NARROWER", {library.native().profile.target: (other,)})
    seen = []

    def planted(weights, lib=None, rounds=3, others=None):
        seen.append(sorted(others or {}))
        return {c: {"tiles": 1.0, f"{other} tiles": other_ms} for c in ("1-1", "2-4", "5-16")}

    monkeypatch.setattr(schedules, "measure", planted)
    from toolkit.config import ModelConfig
    from toolkit.models import load_model

    loaded = load_model(ModelConfig(name="tiny", seed=0))
    engine = make_engine(loaded)
    assert seen == [[other]]  # the other build was timed beside the own
    assert engine.matmul_schedule.builds == () and set(loaded.model._packed) == {""}


def test_auto_over_one_build_and_the_cache_keep_the_other_build(tmp_path, monkeypatch):
    """auto:<target> measures that build's schedules alone; the kept choice names the build; a build this engine's
    matmul cannot run is a one-line error, and the config refuses an unknown target."""
    other = _other_fma_build()
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(schedules, "NARROWER", {library.native().profile.target: (other,)})
    layers = [pack_weight(torch.randn(64, 96)) for _ in range(2)]
    calls = []

    def planted(weights, lib=None, rounds=3, others=None):
        calls.append((len(weights), sorted(others or {})))
        times = {**({f"{other} pairs": 1.0} if others else {}), **({"tiles": 2.0} if weights else {})}
        return dict.fromkeys(("1-1", "2-4", "5-16"), times)

    monkeypatch.setattr(schedules, "measure", planted)
    duels = []
    monkeypatch.setattr(
        schedules, "duel", lambda runs, rows: duels.append(rows) or {r[0]: 1.0 if " " in r[0] else 2.0 for r in runs}
    )
    repack = lambda lib: ([pack_weight(torch.randn(64, 96), lib) for _ in range(2)], None)  # noqa: E731
    only = schedules.choose(f"auto:{other}", layers, packed_for=repack)
    assert calls == [(0, [other])] and only.builds == (other,) * 3 and only.choice == ("pairs",) * 3
    assert duels == []  # no own build measured: nothing to confirm against
    both = schedules.choose("auto", layers, packed_for=repack)
    assert calls[-1] == (2, [other]) and both.builds == (other,) * 3 and duels == [1, 3, 10]
    again = schedules.choose("auto", layers, packed_for=repack)
    assert len(calls) == 2 and "kept in" in again.how and again.builds == both.builds
    kept = [json.loads(p.read_text())["choice"] for p in tmp_path.rglob("schedule-*.json")]
    assert [f"{other} pairs"] * 3 in kept and len(kept) == 2  # auto and auto:<other> are kept apart
    assert schedules.choose("auto", layers).builds == ()  # no packer: the own build's alone (measured anew)
    with pytest.raises(ValueError, match="this engine's matmul runs in"):
        schedules.choose("auto:scalar", layers, packed_for=repack)
    assert f"auto:{other.partition('/')[0]}" in MATMUL_BUILD_SCHEDULES
    EngineConfig(matmul_schedule="auto:x86-64-v3")
    with pytest.raises(ConfigError, match="auto:<kernel target>"):
        EngineConfig(matmul_schedule="auto:x86-64-v9")


def test_the_configs_targets_are_the_kernels():
    assert MATMUL_BUILD_SCHEDULES == schedules.BUILD_SETTINGS


def test_a_surveys_pick_of_another_build_that_loses_the_duel_is_not_taken(tmp_path, monkeypatch):
    """The survey (fastest of three rounds) picks another build by more than the margin at one row and at 10 rows;
    the duel (medians of alternating rounds) confirms the first and not the second: only the first runs it, and
    the duel's medians are kept beside the survey's."""
    other = _other_fma_build()
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(schedules, "NARROWER", {library.native().profile.target: (other,)})
    monkeypatch.setattr(
        schedules,
        "measure",
        lambda weights, lib=None, rounds=3, others=None: {
            "1-1": {"quads-nopf": 2.0, f"{other} quads-nopf": 1.0},
            "2-4": {"tiles-nopf": 1.0, f"{other} tiles": 3.0},
            "5-16": {"tiles": 2.0, f"{other} pairs": 1.0},
        },
    )
    medians = {1: (2.0, 1.5), 10: (2.0, 1.95)}  # rows -> (own, other): the second within the margin
    monkeypatch.setattr(schedules, "duel", lambda runs, rows: {r[0]: medians[rows][" " in r[0]] for r in runs})
    layers = [pack_weight(torch.randn(64, 96)) for _ in range(2)]
    repack = lambda lib: ([pack_weight(torch.randn(64, 96), lib) for _ in range(2)], None)  # noqa: E731
    chosen = schedules.choose("auto", layers, packed_for=repack)
    assert chosen.choice == ("quads-nopf", "tiles-nopf", "tiles") and chosen.builds == (other, "", "")
    (kept,) = [json.loads(p.read_text()) for p in tmp_path.rglob("schedule-*.json")]
    assert kept["confirmed"] == {
        "1-1": {"quads-nopf": 2.0, f"{other} quads-nopf": 1.5},
        "5-16": {"tiles": 2.0, f"{other} pairs": 1.95},
    }
