"""The audit's and verify's recomputation sharded over Ray (toolkit.reproduce.shard): a local Ray cluster here,
the same answers as the local run, value for value and in the same order.

Shards are contiguous runs of requests balanced by tokens (property-tested); answers arrive in any order and are
joined in shard order (a merge in arrival order is caught deterministically below); 200 transcripts audited on
two Ray workers give the local run's audit.json, audit.parquet and converted trace, and a trace verified on
Ray gives the local verify.json and verify.parquet.
"""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import native_only, once
from toolkit.errors import ConfigError
from toolkit.reproduce.shard import in_order, ray_options, split

ROOT = Path(__file__).resolve().parents[1]
RAY_MISSING = None if importlib.util.find_spec("ray") else "Ray is not installed (pip install 'toolkit[ray]')"


@settings(max_examples=200, deadline=None)
@given(weights=st.lists(st.integers(1, 500), max_size=120), shards=st.integers(1, 40))
def test_shards_are_contiguous_cover_everything_and_share_the_weight(weights, shards):
    parts = split(weights, shards)
    assert [i for p in parts for i in p] == list(range(len(weights)))  # every item once, in order
    assert all(len(p) > 0 for p in parts) and len(parts) <= max(1, shards)
    if weights:
        share = sum(weights) / min(shards, len(weights))
        assert all(sum(weights[i] for i in p) <= share + 2 * max(weights) for p in parts), parts
    if len(set(weights)) == 1 and len(weights) >= shards:
        assert len(parts) == shards


def test_answers_arriving_out_of_order_are_joined_in_shard_order():
    arrived = {2: [["e"], ["E"]], 0: [["a", "b"], ["A", "B"]], 1: [["c", "d"], ["C", "D"]]}  # shard 2 first
    assert in_order(arrived, 2) == [["a", "b", "c", "d", "e"], ["A", "B", "C", "D", "E"]]


def test_bad_ray_options_are_named():
    with pytest.raises(ConfigError, match=r"audit.ray.workers must be a positive integer, got 0"):
        ray_options({"ray": {"workers": 0}})
    with pytest.raises(ConfigError, match=r"verify.ray: unknown keys \['nodes'\]"):
        ray_options({"ray": {"nodes": 3}}, "verify")
    with pytest.raises(ConfigError, match=r"verify.ray must be a mapping of address, workers"):
        ray_options({"ray": 5}, "verify")  # a TypeError traceback before


def test_a_cluster_that_cannot_answer_or_place_a_worker_is_one_line_before_any_wait():
    """ray.init retried an address where nothing listens for ever, and an actor asking for more CPUs than the
    cluster has waited for ever, silently: each is one line now; a cluster with room for fewer workers than asked
    gets as many as fit (the answers are the same: each shard is recomputed alone)."""
    from toolkit.errors import ClusterError
    from toolkit.reproduce.shard import RayOptions, check_reachable, placeable

    with pytest.raises(ClusterError, match=r"verify.ray.address=127.0.0.1:1: no Ray cluster answers there"):
        check_reachable("127.0.0.1:1", "verify")
    check_reachable("auto", "verify")  # left to Ray, which finds a running cluster or says there is none
    with pytest.raises(
        ClusterError, match=r"verify.ray.threads=2: a worker asks for 2 CPUs, and the Ray cluster has 1"
    ):
        placeable(1.0, RayOptions(workers=2, threads=2), 8, "verify")
    assert placeable(5.0, RayOptions(workers=4, threads=2), 8, "audit") == 2
    assert placeable(16.0, RayOptions(workers=4, threads=2), 3, "audit") == 3  # a worker a shard at most
    if RAY_MISSING:
        print(f"SKIP reason (the rest): {RAY_MISSING}")
        return
    from toolkit.reproduce.shard import run_on_ray

    with pytest.raises(ClusterError, match=r"verify.ray.address=auto: cannot join that Ray cluster: ConnectionError"):
        run_on_ray({}, RayOptions(address="auto"), [1], "verify", None, None)  # no cluster runs: a traceback before


def _cli(*args, timeout=600):
    return subprocess.run(
        [sys.executable, str(ROOT / "run.py"), *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout
    )


def _table(path, drop=("run_id",)):
    """The rows as JSON text (NaN written as NaN, so equal NaNs compare equal), without the random run_id."""
    table = pq.read_table(path)
    return [
        json.dumps(row, sort_keys=True, default=str)
        for row in table.drop_columns([c for c in drop if c in table.column_names]).to_pylist()
    ]


@pytest.fixture(scope="module")
def many(tiny, tmp_path_factory):
    """200 transcripts for the tiny model: token ids of random lengths, each claim some logprob (what the
    sharding must keep is every recomputed value and its order, whatever was claimed)."""
    path = tmp_path_factory.mktemp("shard") / "many.jsonl"
    g = random.Random(0)
    lines = []
    for i in range(200):
        output = [g.randrange(100, 40000) for _ in range(8)]
        prompt = [g.randrange(100, 40000) for _ in range(g.randrange(4, 24))]
        lines.append(
            {
                "request_id": f"r{i}",
                "prompt_token_ids": prompt,
                "output_token_ids": output,
                "logprobs": [-g.uniform(5, 15) for _ in output],
                "sampling": {"temperature": 1.0},
            }
        )
    path.write_text("".join(json.dumps(o) + "\n" for o in lines))
    return path


@pytest.mark.native
@once
def test_a_ray_sharded_audit_equals_the_local_one(many, tmp_path):
    if RAY_MISSING:
        print(f"SKIP reason: {RAY_MISSING}")
        pytest.skip(RAY_MISSING)
    runs = {}
    for name, extra in [("local", []), ("ray", ["audit.launcher=ray", "audit.ray.shards_per_worker=8"])]:
        out = tmp_path / name
        proc = _cli(
            "mode=audit",
            "model=tiny",
            f"hydra.run.dir={out}",
            f"audit.input={many}",
            "audit.format=token_ids",
            "audit.reference=[ours@float32,ours]",
            *extra,
        )
        assert proc.returncode == 1, proc.stderr[-2000:]  # the random claims are flagged: exit code 1
        runs[name] = out
    local, ray = (json.loads((runs[n] / "audit.json").read_text()) for n in ("local", "ray"))
    assert local["tokens"] == 200 * 8 and len(local["requests"]) == 200 and local["flagged_tokens"] > 0
    # every value, every request in the same order, both references: our fp32 engine and the float64 reference,
    # whose bits do not depend on the thread count (local: 2 threads, a Ray worker: 1) or the shard
    assert ray == local
    for name in ("audit.parquet", "requests.parquet", "samples.parquet"):
        a, b = (_table(runs[n] / name) for n in ("local", "ray"))
        assert a == b and len(a) >= 200, name


@pytest.mark.native
@once
def test_a_ray_sharded_verify_equals_the_local_one(tmp_path):
    if RAY_MISSING:
        print(f"SKIP reason: {RAY_MISSING}")
        pytest.skip(RAY_MISSING)
    from toolkit.reproduce.shard import RayOptions
    from toolkit.reproduce.verify import verify

    trace = tmp_path / "trace"
    proc = _cli(
        "model=tiny",
        f"hydra.run.dir={trace}",
        "workload.num_requests=24",
        "workload.min_tokens=4",
        "workload.max_tokens=12",
        "print_outputs=false",
        "report.auto=false",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    local = verify(trace, out_dir=tmp_path / "local")
    ray = verify(trace, out_dir=tmp_path / "ray", ray=RayOptions(workers=2, shards_per_worker=4))
    assert local.sequences_checked == 24 and local.rows_checked > 24 and local.passed
    assert ray.to_dict() == local.to_dict()
    assert _table(tmp_path / "local" / "verify.parquet") == _table(tmp_path / "ray" / "verify.parquet")


@pytest.mark.native
def test_packed_recomputation_gives_each_request_the_bits_it_gets_alone(tiny, many):
    from toolkit.audit.checks import audit_transcripts
    from toolkit.audit.references import EngineForward
    from toolkit.audit.transcripts import read_transcripts

    records, _ = read_transcripts(many, "hf", tiny.tokenizer, tiny.arch.vocab_size)
    records = records[:40]
    packed = EngineForward(tiny.model, max_tokens=300)  # several forwards of several requests each
    alone = lambda ids: packed(ids)  # noqa: E731  (no `many`: one request a forward)
    a, b = (audit_transcripts(records, f, tiny, atol=1e-4, reference="ours@float32").to_dict() for f in (packed, alone))
    assert a == b and a["tokens"] == 40 * 8
    assert [r["request_id"] for r in a["requests"]] == [r.request_id for r in records]


def _group_sequences(
    seed: int, prompts: int, samples: int, vocab: int, repeat: bool = False
) -> tuple[list[list[int]], list[int]]:
    """RL-shaped sequences: `samples` continuations of each of `prompts` prompts (one shared system prefix; with
    `repeat`, one token 37 times, so its first two blocks hold the same tokens at different positions)."""
    rng = random.Random(seed)
    system = [0] * 37 if repeat else [rng.randrange(vocab) for _ in range(21)]
    sequences, last = [], []
    for _ in range(prompts):
        prompt = system + [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        for _ in range(samples):
            out = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
            sequences.append(prompt + out)
            last.append(len(out))
    return sequences, last


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    prompts=st.integers(1, 5),
    samples=st.integers(1, 5),
    vocab=st.sampled_from([2, 50]),
    repeat=st.booleans(),
    max_tokens=st.sampled_from([1, 64, 300, 4096]),
)
def test_a_pack_reads_a_shared_block_only_where_it_holds_the_same_tokens_at_the_same_positions(
    seed, prompts, samples, vocab, repeat, max_tokens
):
    from toolkit.engine.runner import plan_packs

    bs = 16
    sequences, last = _group_sequences(seed, prompts, samples, vocab, repeat)
    packs = plan_packs(sequences, last, bs, max_tokens)
    chunks = [c for p in packs for c in p.chunks]
    assert [int(c.seq_id) for c in chunks] == list(range(len(sequences)))  # every sequence once, in order
    for pack in packs:
        written: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (first position, tokens) its owner writes
        for c in pack.chunks:
            ids = sequences[int(c.seq_id)]
            assert c.start_pos % bs == 0 and c.start_pos + c.num_tokens == len(ids)
            assert c.num_logits == last[int(c.seq_id)]
            assert c.start_pos <= len(ids) - c.num_logits  # every wanted logit row is computed by its own chunk
            assert len(c.block_table) == -(-len(ids) // bs)
            for b in range(c.start_pos // bs, len(c.block_table)):
                assert c.block_table[b] not in written  # a block has one writer
                written[c.block_table[b]] = (b * bs, tuple(ids[b * bs : (b + 1) * bs]))
        assert sorted(written) == list(range(pack.num_blocks))
        for c in pack.chunks:  # every block a chunk reads holds its own tokens at its own positions
            ids = sequences[int(c.seq_id)]
            for b, block in enumerate(c.block_table[: c.start_pos // bs]):
                assert written[block] == (b * bs, tuple(ids[b * bs : (b + 1) * bs]))
        assert pack.computed == sum(c.num_tokens for c in pack.chunks)
        assert pack.computed <= max_tokens or len(pack.chunks) == 1
    if max_tokens == 4096 and vocab == 50:  # one pack: each sample after its prompt's first reads the prompt's full
        system = 2 if repeat else 1  # blocks; each prompt after the first, the system prompt's (prompts of 50
        # random tokens: no two share a block by chance)
        assert (
            packs[0].computed
            == sum(map(len, sequences))
            - sum((len(s) - k) // bs * bs for j, (s, k) in enumerate(zip(sequences, last)) if j % samples)
            - (prompts - 1) * system * bs
        )


@native_only  # sharing is the kernel path's: without the kernels each sequence runs alone on sdpa
def test_prompt_blocks_shared_in_a_pack_give_each_sequence_the_bits_it_gets_alone(tiny):
    from toolkit.engine.runner import recompute_logits, recompute_many

    sequences, last = _group_sequences(3, prompts=3, samples=4, vocab=tiny.arch.vocab_size)
    counts: dict[str, int] = {}
    packed = recompute_many(tiny.model, sequences, last, max_tokens=300, counts=counts)  # several packs
    alone = [recompute_logits(tiny.model, s)[len(s) - k :] for s, k in zip(sequences, last)]
    assert all(torch.equal(p, a) for p, a in zip(packed, alone))
    assert counts["tokens"] == sum(map(len, sequences)) and counts["computed"] < 0.7 * counts["tokens"]
