"""Speculative decoding: greedy equality, exact target distribution (rejection and coupled), coupled
equality with plain sampling, replay, grammar, one target forward per step."""

from __future__ import annotations

import functools
import itertools
import json
import re

import pytest
import torch

from tests.conftest import NATIVE_OFF, make_engine
from tests.numerics import assert_greedy_agreement, greedy_with_margins
from tests.stats import chi_square
from toolkit import replay
from toolkit.config import EngineConfig, ModelConfig, SpeculativeConfig
from toolkit.engine import decide as decide_module
from toolkit.engine import speculative
from toolkit.engine.core import Engine
from toolkit.models import load_model
from toolkit.models.reference import reference_logits
from toolkit.sampling.params import SamplingParams

COPY_PROMPTS = [
    "Repeat exactly: The quick brown fox jumps over the lazy dog. The quick brown fox jumps.",
    "Copy this sentence twice: I like green apples and red cherries.",
    "Write a haiku about rain.",
    "List the days of the week.",
]


def spec_engine(loaded, method: str, acceptance: str = "rejection", k: int = 4, **engine_kwargs):
    extra = {"draft_layers": 1} if method == "self_draft" and loaded.arch.num_layers <= 2 else {}
    if method == "self_draft" and loaded.arch.num_layers > 2:
        extra = {"draft_layers": 8}
    if method == "draft_model":
        extra = {"draft_model": {"name": "tiny", "seed": 77, "vocab_size": loaded.arch.vocab_size}}
    cfg = SpeculativeConfig(method=method, num_speculative_tokens=k, acceptance=acceptance, **extra)
    return Engine(loaded, EngineConfig(**engine_kwargs), SamplingParams(temperature=0.0), cfg)


def greedy_requests(loaded, max_tokens=32):
    return [
        {
            "messages": [{"role": "user", "content": p}],
            "request_id": f"p{i}",
            "arrival_step": i,
            "sampling_params": SamplingParams(temperature=0.0, max_tokens=max_tokens),
        }
        for i, p in enumerate(COPY_PROMPTS)
    ]


@pytest.mark.native
@pytest.mark.parametrize("method", ["ngram", "self_draft", "draft_model"])
def test_tiny_greedy_speculation_equals_plain_greedy(tiny, method):
    requests = greedy_requests(tiny)
    plain = [o.output_token_ids for o in make_engine(tiny).generate(requests)]
    engine = spec_engine(tiny, method, max_num_batched_tokens=64, max_num_seqs=4)
    assert [o.output_token_ids for o in engine.generate(requests)] == plain
    assert engine.speculator.stats.proposed > 0
    if method == "self_draft":  # the target's weights: its matmul schedule, not a second choice
        assert engine.speculator.proposer.runner.matmul_schedule is engine.matmul_schedule


@pytest.mark.native
@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("method", ["ngram", "self_draft"])
def test_smollm2_greedy_speculation_equals_plain_greedy(smollm2, method):
    """Token for token the plain greedy output. The native kernels give a row the same bits in a k+1-token
    verify chunk as in a decode step, so nothing may differ; torch's fallback sums a chunk in another order than
    a row, and there a divergence is allowed only at a near-tie of the plain run (tests/numerics.py): a margin
    under 1e-3, ten times the bound fp32 logits of the same weights keep from HF's (test_oracle)."""
    requests = greedy_requests(smollm2, max_tokens=40)
    plain, margins = greedy_with_margins(make_engine(smollm2), requests)
    engine = spec_engine(smollm2, method)
    speculated = {r["request_id"]: list(o.output_token_ids) for r, o in zip(requests, engine.generate(requests))}
    agreement = assert_greedy_agreement(plain, margins, speculated, window=40, near_tie=1e-3 if NATIVE_OFF else 0.0)
    assert agreement.checked, agreement.report()
    if method == "ngram":
        assert engine.speculator.stats.accepted > 10  # the copy prompts do get long accepted runs


@pytest.mark.native
def test_one_target_forward_per_step_with_speculation(tiny):
    engine = spec_engine(tiny, "draft_model", max_num_batched_tokens=64, max_num_seqs=4)
    calls = 0
    original = engine.runner.model.forward

    def counting(*args, **kwargs):
        nonlocal calls
        calls += 1
        return original(*args, **kwargs)

    engine.runner.model = type("M", (), {"__call__": lambda self, *a, **k: counting(*a, **k), "arch": tiny.arch})()
    for r in greedy_requests(tiny):
        engine.add_request(**r)
    busy = 0
    while engine.has_unfinished():
        out = engine.step()
        busy += out.batch_size > 0
    assert calls == busy  # drafts run on the draft model's runner, the target forward stays one per step


# --------------------------------------------------------------------------- exactness in distribution

VOCAB, PROMPT, PARAMS = 12, [3, 5], dict(temperature=0.9, top_k=8)


@functools.lru_cache(maxsize=1)
def small_models():
    target = load_model(ModelConfig(name="tiny", seed=5, vocab_size=VOCAB))
    return target


def processed_probs(model, tokens: list[int]) -> torch.Tensor:
    logits = reference_logits(model.model, tokens)[-1] / PARAMS["temperature"]
    kth = torch.topk(logits, PARAMS["top_k"]).values[-1]
    return torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)


def exact_marginals(model) -> list[list[float]]:
    """P(x1), P(x2), P(x3) of the processed target distribution, by enumerating prefixes."""
    p1 = processed_probs(model, PROMPT)
    p2 = torch.zeros(VOCAB, dtype=torch.float64)
    p3 = torch.zeros(VOCAB, dtype=torch.float64)
    for a in range(VOCAB):
        if p1[a] == 0:
            continue
        pa = processed_probs(model, PROMPT + [a])
        p2 += p1[a] * pa
        for b in range(VOCAB):
            if pa[b] > 0:
                p3 += p1[a] * pa[b] * processed_probs(model, PROMPT + [a, b])
    return [p1.tolist(), p2.tolist(), p3.tolist()]


def speculative_samples(acceptance: str, n: int = 6000) -> list[tuple[int, ...]]:
    """`n` seeded 3-token samples (6000: resampling from p instead of the residual already gives p ~ 1e-84 at
    the second position, and the chi-square's false alarm rate does not depend on n)."""
    target = small_models()
    cfg = SpeculativeConfig(
        method="draft_model",
        num_speculative_tokens=2,
        acceptance=acceptance,
        draft_model={"name": "tiny", "seed": 77, "vocab_size": VOCAB},
    )
    engine = Engine(
        target,
        EngineConfig(max_num_seqs=512, max_num_batched_tokens=2048, num_kv_blocks=4096, block_size=4),
        SamplingParams(),
        cfg,
    )
    outs = engine.generate(
        [
            {
                "prompt_token_ids": PROMPT,
                "sampling_params": SamplingParams(seed=i, max_tokens=3, ignore_eos=True, **PARAMS),
            }
            for i in range(n)
        ]
    )
    stats = engine.speculator.stats
    assert stats.accepted > 0.2 * stats.proposed  # the draft is close enough for both branches to be exercised
    return [o.output_token_ids for o in outs]


def assert_matches(samples, marginals):
    for pos in range(3):
        stat, p_value = chi_square([s[pos] for s in samples], marginals[pos])
        assert p_value > 1e-3, (pos, stat, p_value)


@pytest.mark.native
@pytest.mark.parametrize("acceptance", ["rejection", "coupled"])
def test_speculative_samples_follow_the_target_distribution(acceptance):
    assert_matches(speculative_samples(acceptance), exact_marginals(small_models()))


@pytest.mark.native
def test_resampling_from_p_instead_of_the_residual_fails(monkeypatch):
    monkeypatch.setattr(decide_module, "verify", functools.partial(speculative.verify, residual_from_p=True))
    samples = speculative_samples("rejection", n=3000)  # p ~ 1e-42 at the second position
    with pytest.raises(AssertionError):
        assert_matches(samples, exact_marginals(small_models()))


@pytest.mark.native
def test_coupled_equals_plain_sampling_with_the_same_seeds(tiny):
    requests = [
        {
            "prompt_token_ids": list(range(7 * i + 1, 7 * i + 12)),
            "request_id": f"c{i}",
            "arrival_step": i,
            "sampling_params": SamplingParams(temperature=1.0, seed=40 + i, max_tokens=24, ignore_eos=True),
        }
        for i in range(6)
    ]
    plain = [
        o.output_token_ids for o in make_engine(tiny, max_num_batched_tokens=64, max_num_seqs=6).generate(requests)
    ]
    engine = spec_engine(tiny, "draft_model", "coupled", max_num_batched_tokens=64, max_num_seqs=6)
    coupled = [o.output_token_ids for o in engine.generate(requests)]
    same = sum(a == b for a, b in zip(itertools.chain(*plain), itertools.chain(*coupled)))
    assert same / sum(map(len, plain)) >= 0.99  # exactly equal once bits are batch-invariant
    assert engine.speculator.stats.accepted > 0


# --------------------------------------------------------------------------- trace, replay, grammar


@pytest.mark.native
def test_speculative_trace_and_replay(tiny, tmp_path):
    from toolkit.runs.session import record
    from toolkit.trace.reader import read_samples

    engine = spec_engine(tiny, "ngram", "rejection", max_num_batched_tokens=64, max_num_seqs=4)
    ids = [
        engine.add_request(
            prompt_token_ids=[1, 2, 3, 4, 1, 2, 3, 4, 1, 2],
            request_id=f"r{i}",
            sampling_params=SamplingParams(temperature=1.0 if i else 0.0, seed=i, max_tokens=16, ignore_eos=True),
        )
        for i in range(3)
    ]
    config = {"model": {"name": "tiny", "seed": 0}, "speculative": {"method": "ngram", "acceptance": "rejection"}}
    record(engine, ids, tmp_path / "run", config)
    rows = read_samples(tmp_path / "run").to_pylist()
    origins = {r["origin"] for r in rows}
    assert origins <= {"plain", "draft_accepted", "resampled", "bonus"} and "draft_accepted" in origins
    assert all(r["spec_proposed"] >= r["spec_accepted"] for r in rows)
    for rid in ids:  # positions are contiguous: one row per emitted token
        positions = [r["position"] for r in rows if r["request_id"] == rid]
        assert positions == list(range(10, 10 + len(positions)))
    report = replay(tmp_path / "run", out_dir=tmp_path / "replay")
    assert report.identical, report.summary_line()


@pytest.mark.native
def test_a_self_draft_never_writes_a_block_before_its_swap_moved_it(tiny, tmp_path):
    """A self-draft's forward writes the target's cache: a block a swap-out frees this step must reach the host
    before the draft writes it, and a swapped-in block be in place before the draft reads it. A pool of 12 blocks
    of 8 for four sequences of 48 tokens swaps every few steps; every recorded logprob is then the recomputed one
    (the draft ran before the copies: verify failed at |diff| 0.58)."""
    from toolkit.reproduce.verify import verify
    from toolkit.runs.session import record

    engine = spec_engine(
        tiny,
        "self_draft",
        max_num_batched_tokens=16,
        max_num_seqs=4,
        num_kv_blocks=12,
        block_size=8,
        preemption_mode="swap",
    )
    swaps = []
    move = engine.runner.move_blocks
    engine.runner.move_blocks = lambda batch: (swaps.append(len(batch.swap_out) + len(batch.swap_in)), move(batch))
    ids = [
        engine.add_request(
            prompt_token_ids=list(range(30 * i + 3, 30 * i + 27)),
            request_id=f"s{i}",
            sampling_params=SamplingParams(temperature=1.0, seed=i, n=2, max_tokens=24, ignore_eos=True),
        )
        for i in range(2)
    ]
    config = {"model": {"name": "tiny", "seed": 0}, "speculative": {"method": "self_draft", "draft_layers": 1}}
    record(engine, ids, tmp_path / "run", config)
    assert sum(swaps) >= 2 and engine.speculator.stats.proposed > 0
    report = verify(tmp_path / "run")
    assert report.passed and report.rows_checked == 4 * 24, report.summary_line()


@pytest.mark.native
def test_grammar_and_speculation_keep_outputs_valid(tiny):
    engine = spec_engine(tiny, "draft_model", "rejection", max_num_batched_tokens=64, max_num_seqs=8)
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
        "required": ["a", "b"],
    }
    specs = [{"json": schema}, {"regex": r"(ab|cd){2,8}"}, {"choice": ["left", "right"]}]
    requests = [
        {
            "prompt_token_ids": [i + 1, i + 2],
            "sampling_params": SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured_outputs=specs[i % 3]),
        }
        for i in range(9)
    ]
    for r, out in zip(requests, engine.generate(requests)):
        spec = r["sampling_params"].structured_outputs
        matcher = engine.grammar.matcher(spec)
        assert all(matcher.accept_token(t) for t in out.output_token_ids)
        if out.finish_reason == "stop":
            if spec.kind == "json":
                json.loads(out.text)
            elif spec.kind == "regex":
                assert re.fullmatch(spec.regex, out.text)
            else:
                assert out.text in spec.choice
    assert engine.speculator.stats.proposed > 0


@pytest.mark.native
def test_drafting_and_verifying_never_move_a_committed_grammar_matcher(tiny, monkeypatch):
    """Draft tokens and verification depths look ahead on forks of a sequence's matcher: the committed
    matcher is advanced only by committed tokens and never rolled back (the engine used to advance it
    through the drafts and roll it back)."""
    import xgrammar

    forks = []
    real_fork = xgrammar.GrammarMatcher.fork

    def counted_fork(self):
        forks.append(1)
        return real_fork(self)

    def no_rollback(self, n):
        raise AssertionError(f"a committed grammar matcher was rolled back by {n} tokens")

    monkeypatch.setattr(xgrammar.GrammarMatcher, "fork", counted_fork)
    monkeypatch.setattr(xgrammar.GrammarMatcher, "rollback", no_rollback)
    engine = spec_engine(tiny, "draft_model", "rejection", max_num_batched_tokens=64, max_num_seqs=8)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    requests = [
        {
            "prompt_token_ids": [i + 1, i + 2],
            "sampling_params": SamplingParams(
                temperature=1.0, seed=i, max_tokens=40, structured_outputs={"json": schema}
            ),
        }
        for i in range(4)
    ]
    outs = engine.generate(requests)
    assert engine.speculator.stats.proposed > 0 and forks
    for out in outs:
        matcher = engine.grammar.matcher(SamplingParams(structured_outputs={"json": schema}).structured_outputs)
        assert all(matcher.accept_token(t) for t in out.output_token_ids)


def test_bad_speculative_configs():
    from toolkit.errors import ConfigError

    with pytest.raises(ConfigError, match="speculative.method must be one of"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ConfigError, match="needs speculative.draft_model"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=0)


@pytest.mark.native
def test_a_draft_that_reaches_fewer_positions_than_the_context_is_refused_at_start(tiny):
    """A draft model drafts at every position of the target's context: one of 16 positions crashed the first step
    past them with an IndexError from the rotary table; it is a one-line ConfigError when the engine is built."""
    from toolkit.errors import ConfigError

    cfg = SpeculativeConfig(method="draft_model", draft_model={"name": "tiny", "max_position_embeddings": 16})
    with pytest.raises(ConfigError, match="reaches 16 positions, the target's context 2048"):
        Engine(tiny, EngineConfig(), SamplingParams(), cfg)
    short = Engine(tiny, EngineConfig(max_model_len=16), SamplingParams(temperature=0.0), cfg)  # within its reach
    out = short.generate([{"prompt_token_ids": [1, 2, 3], "sampling_params": SamplingParams(max_tokens=12)}])
    assert len(out[0].output_token_ids) == 12
