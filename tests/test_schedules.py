"""The packed matmul's schedules (toolkit/native/schedules.py): every one gives the same bits, and the choice per
class of rows is measured, kept per CPU and build, fixed under batch invariance and recorded in the manifest."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import make_engine, native_only
from toolkit.config import MATMUL_SCHEDULES, EngineConfig
from toolkit.errors import ConfigError
from toolkit.native import library, memory, schedules
from toolkit.native.ops import fixed_schedule, matmul_invariant, pack_weight, packed_arena
from toolkit.runs.manifest import native_kernels
from toolkit.sampling.params import SamplingParams

pytestmark = native_only
SCHEDULES_OF = schedules.SCHEDULES.__getitem__


@settings(max_examples=40)
@given(
    rows=st.integers(1, 20),
    k=st.integers(1, 300),
    n=st.integers(1, 700),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    threads=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**16),
)
def test_every_schedule_gives_the_same_bits(rows, k, n, dtype, threads, seed):
    """Each schedule streams the weights its own way (panels in groups of 2 or 4, rows 2 or 1 at a time, ranges a
    thread), but every output is the one FMA chain over k in order: equal to the tiles', and to the row's alone,
    bit for bit, at any rows, shapes (odd panels, narrow panels, tail columns), format and threads."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(k, n, generator=gen).to(dtype)
    packed = pack_weight(w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want = matmul_invariant(x, packed, schedule=0)
        for s in range(1, len(schedules.SCHEDULES)):
            assert torch.equal(matmul_invariant(x, packed, schedule=s), want), schedules.SCHEDULES[s]
            assert torch.equal(matmul_invariant(x[-1:], packed, schedule=s)[0], want[-1]), schedules.SCHEDULES[s]
    finally:
        torch.set_num_threads(before)
    exact = x.double() @ w.double()  # and the chain is the product (a schedule skipping a k or a panel is not)
    assert (want.double() - exact).abs().max() <= 1e-5 * k**0.5 * 8 * max(1.0, exact.abs().max().item())


def test_an_unknown_schedule_is_refused_not_run():
    packed = pack_weight(torch.ones(8, 40))
    with pytest.raises(ValueError, match="no matmul schedule 8"):
        matmul_invariant(torch.ones(1, 8), packed, schedule=8)


def test_the_settings_choose_as_documented(tmp_path, monkeypatch):
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    layers = [pack_weight(torch.randn(64, 96)) for _ in range(3)]
    forced = schedules.choose("quads", layers)
    assert forced.choice == ("quads",) * 3 and [forced.for_rows(m) for m in (1, 3, 9, 17, 500)] == [2, 2, 2, 0, 0]
    assert [SCHEDULES_OF(fixed_schedule(m)) for m in (1, 2, 16, 17)] == ["pairs", "tiles", "tiles", "tiles"]
    fixed = schedules.choose("auto", layers, batch_invariant=True)
    assert fixed.choice == schedules.FIXED and "batch_invariant" in fixed.describe()
    assert [fixed.for_rows(m) for m in (1, 2, 16, 17)] == [1, 0, 0, 0]
    assert [fixed.for_rows(m) for m in range(1, 40)] == [fixed_schedule(m) for m in range(1, 40)]  # one fixed choice
    assert schedules.choose("fixed", layers).choice == schedules.FIXED
    with pytest.raises(ValueError, match="engine.matmul_schedule must be one of"):
        schedules.choose("fastest", layers)
    assert not list(tmp_path.rglob("schedule-*.json"))  # nothing measured, nothing kept


def test_auto_takes_the_fastest_measured_and_keeps_it_per_cpu_and_build(tmp_path, monkeypatch):
    """The fastest schedule of each class wins (a tie goes to the fixed one); the choice is written once and read
    back (no second measurement); a damaged file is measured again; other weights' shapes get their own key."""
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    slow = {f"{name}-nopf": 10.0 for name in schedules.LOOPS}
    planted = {
        "1-1": {"tiles": 3.0, "pairs": 2.0, "quads": 1.0, **slow, "quads-nopf": 0.5},
        "2-4": {"tiles": 2.0, "pairs": 2.0, "quads": 2.5, **slow, "pairs-nopf": 2.0},  # a tie: the fixed choice stays
        "5-16": {"tiles": 9.0, "pairs": 4.0, "quads": 8.0, **slow},
    }
    calls = []
    monkeypatch.setattr(
        schedules, "measure", lambda weights, lib=None, others=None: calls.append(len(weights)) or planted
    )
    layers = [pack_weight(torch.randn(64, 96)) for _ in range(3)]
    first = schedules.choose("auto", layers, pack_weight(torch.randn(64, 500)))
    assert first.choice == ("quads-nopf", "tiles", "pairs") and first.how == "measured at first use"
    assert calls == [4]  # the layers and the head, timed together
    again = schedules.choose("auto", layers, pack_weight(torch.randn(64, 500)))
    assert again.choice == first.choice and "kept in schedule-" in again.how and calls == [4]
    (kept,) = tmp_path.rglob("schedule-*.json")
    assert json.loads(kept.read_text())["choice"] == ["quads-nopf", "tiles", "pairs"]
    kept.write_text("{not json")
    assert schedules.choose("auto", layers, pack_weight(torch.randn(64, 500))).how == "measured at first use"
    assert calls == [4, 4]
    schedules.choose("auto", [pack_weight(torch.randn(64, 128))])
    assert calls == [4, 4, 1] and len(list(tmp_path.rglob("schedule-*.json"))) == 2


def test_a_cache_it_cannot_write_keeps_the_choice_for_the_process(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache's directory would be")
    monkeypatch.setenv("TOOLKIT_CACHE", str(blocked))
    planted = {
        c: {"tiles": 2.0, "pairs": 1.0, "quads": 3.0, "tiles-nopf": 2.0, "pairs-nopf": 1.5, "quads-nopf": 4.0}
        for c in ("1-1", "2-4", "5-16")
    }
    monkeypatch.setattr(schedules, "measure", lambda weights, lib=None, others=None: planted)
    chosen = schedules.choose("auto", [pack_weight(torch.randn(64, 96))])
    assert chosen.choice == ("pairs",) * 3 and "not kept" in chosen.how


def test_measure_times_every_schedule_of_every_class():
    ms = schedules.measure([pack_weight(torch.randn(128, 256))], rounds=1)
    assert list(ms) == ["1-1", "2-4", "5-16"]
    assert all(set(v) == set(schedules.SCHEDULES) and min(v.values()) > 0 for v in ms.values())


def mixed_run(engine) -> dict:
    """Three sampled requests of different prompt lengths, run to the end (prefill chunks beside 1 to 3 decode rows a
    step, with max_num_batched_tokens=24 and max_num_seqs=3): each sampled row's logits by (request, position)."""
    for i in range(3):
        engine.add_request(
            prompt_token_ids=[(13 * i + j) % 3000 + 5 for j in range(10 + 7 * i)],
            request_id=f"r{i}",
            sampling_params=SamplingParams(temperature=1.0, seed=i, max_tokens=6, ignore_eos=True),
        )
    rows = {}
    while engine.has_unfinished():
        out = engine.step()
        for i, s in enumerate(out.samples):
            rows[(s.request_id, s.position)] = out.logits_RV[i].clone()
    return rows


def test_the_engine_gives_the_same_tokens_and_logits_in_every_schedule(tiny, tmp_path, monkeypatch):
    """A mixed run (prefill chunks, 1 to 3 decode rows a step) in each schedule: the same logits, bit for bit, and
    the manifest names the schedule and how it was chosen."""
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    seen = {}
    for setting in ("tiles", "pairs", "quads", "quads-nopf", "auto"):
        engine = make_engine(tiny, matmul_schedule=setting, max_num_batched_tokens=24, max_num_seqs=3)
        seen[setting] = mixed_run(engine)
        described = native_kernels(engine)["matmul_schedule"]
        assert described == engine.matmul_schedule.describe()
        assert (setting in described) if setting != "auto" else ("measured at first use" in described)
    for setting, rows in seen.items():
        assert rows.keys() == seen["tiles"].keys()
        assert all(torch.equal(rows[key], seen["tiles"][key]) for key in rows), setting
    invariant = make_engine(tiny, batch_invariant=True)
    assert invariant.matmul_schedule.choice == schedules.FIXED


def test_a_bad_setting_is_one_config_error():
    with pytest.raises(ConfigError, match="engine.matmul_schedule must be one of"):
        EngineConfig(matmul_schedule="fast")


def test_the_build_has_the_schedules_python_names():
    assert library.native().fn["matmul_schedules"]() == len(schedules.SCHEDULES)
    assert MATMUL_SCHEDULES == schedules.SETTINGS  # the config's list (no native import there) is the module's


@settings(max_examples=15, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 200), st.integers(1, 300)), min_size=1, max_size=5),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    huge=st.sampled_from([0, 4096, 2 << 20]),
    seed=st.integers(0, 2**16),
)
def test_weights_packed_in_one_arena_are_the_weights_packed_alone(shapes, dtype, huge, seed):
    """packed_arena packs every weight into one buffer (on huge pages where the kernel gives them): each is the
    same packing, bit for bit, as pack_weight alone, starts on a 64-byte line, and none overlaps another (a weight
    written over its neighbour's first line would change the neighbour's product, which is compared too). `huge`:
    the huge page size the buffer is laid out for (0: torch.empty; 4 KB: every buffer mapped)."""
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(k, n, generator=gen).to(dtype) for k, n in shapes]
    kept = memory.huge_page_bytes
    memory.huge_page_bytes = lambda: huge
    try:
        arena = packed_arena(weights)
    finally:
        memory.huge_page_bytes = kept
    x = {k: torch.randn(2, k, generator=gen) for k, _ in shapes}
    for w, packed in zip(weights, arena):
        alone = pack_weight(w)
        assert torch.equal(packed.data, alone.data) and packed.data.data_ptr() % 64 == 0
        assert torch.equal(matmul_invariant(x[w.shape[0]], packed), matmul_invariant(x[w.shape[0]], alone))
    spans = sorted((p.data.data_ptr(), p.data.data_ptr() + p.data.nbytes) for p in arena)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def test_huge_empty_maps_aligned_advised_memory_or_falls_back(monkeypatch):
    """Where the kernel offers transparent huge pages the buffer starts on a huge page boundary (what MADV_HUGEPAGE
    needs to back it), is writable and sized to the element; where it does not, it is torch.empty's."""
    size = memory.huge_page_bytes()
    if size:
        t = memory.huge_empty(size // 2 + 3, torch.bfloat16)
        assert t.data_ptr() % size == 0 and t.shape == (size // 2 + 3,) and t.dtype == torch.bfloat16
        t.fill_(1.5)
        assert float(t.float().sum()) == 1.5 * t.numel()
    else:
        print("this kernel offers no transparent huge pages: the fallback alone is tested")
    monkeypatch.setattr(memory, "huge_page_bytes", lambda: 0)
    plain = memory.huge_empty(1000, torch.float32)
    assert plain.shape == (1000,) and plain.dtype == torch.float32
    with pytest.raises(ValueError, match="out must be"):
        pack_weight(torch.ones(4, 8), out=torch.empty(31))
