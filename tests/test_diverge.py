"""toolkit.trace.diverge: the one first-divergence implementation (replay, report, compare and the studies call it).
The real-trace properties (each cause named at the changed row) are in test_report.py and test_replay_verify.py."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from toolkit.trace.diverge import first_difference, first_divergences, sequences, token_agreement

tokens = st.lists(st.integers(0, 3), max_size=12)


@given(tokens, tokens)
def test_first_difference_is_the_end_of_the_common_prefix(a, b):
    i = first_difference(a, b)
    if a == b:
        assert i is None
        return
    assert i is not None and a[:i] == b[:i]
    assert i == len(a) or i == len(b) or a[i] != b[i]


def row(rid, pos, token, **more):
    return {
        "request_id": rid,
        "stream": 0,
        "position": pos,
        "token_id": token,
        "raw_logprob": -1.0,
        "processed_logprob": -1.0,
        "noise": 0.5,
        "logits_sha256": f"l{pos}",
        "kept_sha256": f"k{pos}",
        "support_size": 5,
        "finish_reason": None,
        "error": None,
        **more,
    }


@given(st.dictionaries(st.sampled_from("xyz"), tokens, min_size=1), st.data())
def test_first_divergences_agree_with_the_token_streams(streams, data):
    """Rows that differ only in their tokens: each sequence's first divergence is where its token stream first
    differs (a `token` divergence, or `length` where one run stops), and mode=compare's count agrees."""
    other = {rid: data.draw(tokens, label=rid) for rid in streams}
    a = sequences(row(rid, 10 + p, t) for rid, ts in streams.items() for p, t in enumerate(ts))
    b = sequences(row(rid, 10 + p, t) for rid, ts in other.items() for p, t in enumerate(ts))
    found = {d.request_id: d for d in first_divergences(a, b)}
    for rid in streams:
        i = first_difference(streams[rid], other[rid])
        if i is None:
            assert rid not in found
            continue
        d = found[rid]
        assert (d.position, d.index) == (10 + i, i)
        assert d.kind == ("length" if i >= min(len(streams[rid]), len(other[rid])) else "token")
        assert ("cause: " + d.cause) in d.describe()
    agreement = token_agreement(
        {(r["request_id"], 0, r["position"]): r["token_id"] for s in a.values() for r in s},
        {(r["request_id"], 0, r["position"]): r["token_id"] for s in b.values() for r in s},
    )
    shared = sum(min(len(streams[r]), len(other[r])) for r in streams)
    assert agreement.common == shared
    assert agreement.differing == sum(x != y for r in streams for x, y in zip(streams[r], other[r]))
    assert agreement.only_a + agreement.only_b == sum(abs(len(streams[r]) - len(other[r])) for r in streams)
    assert agreement.identical == (streams == other)


def test_token_agreement_counts_rows_and_sequences_one_run_lacks():
    """Before, token_agreement counted only the rows both runs hold: a run cut short (max_tokens 4 vs 8) or one
    missing a whole sequence was described as "identical (N rows)"."""
    a = {("x", 0, p): 1 for p in range(8)} | {("y", 0, p): 2 for p in range(8)} | {("z", 1, 0): 3}
    b = {("x", 0, p): 1 for p in range(4)} | {("y", 0, p): 2 for p in range(8)} | {("w", 0, 5): 4}
    agreement = token_agreement(a, b)
    assert not agreement.identical
    assert (agreement.common, agreement.differing, agreement.only_a, agreement.only_b) == (12, 0, 5, 1)
    assert agreement.describe("the first run", "this run") == (
        "the 12 shared rows agree; 5 rows only in the first run (x from position 4, z#1 missing from this run); "
        "1 row only in this run (w missing from the first run)"
    )
    assert agreement.to_dict()["sequences_only_a"] == ["z#1"]
    assert token_agreement(a, dict(a)).describe() == "identical (17 rows)"


def test_the_most_upstream_field_names_the_cause_and_the_token_leads_the_line():
    a = sequences([row("r", 0, 1), row("r", 1, 2)])
    b = sequences([row("r", 0, 1), row("r", 1, 3, logits_sha256="other", raw_logprob=-2.0)])
    (d,) = first_divergences(a, b)
    assert (d.position, d.kind, d.fields) == (1, "logits", ("logits_sha256", "token_id", "raw_logprob"))
    assert d.describe("recorded", "replayed").startswith(
        "r position 1: token_id recorded 2 vs replayed 3; also logits_sha256, raw_logprob (cause: numerical"
    )
    # a digest one run did not record is not compared (a trace older than schema 6 has no kept-set digest)
    assert first_divergences(a, sequences([row("r", 0, 1, kept_sha256=None), row("r", 1, 2)])) == []


def test_a_draft_that_differs_under_the_same_token_is_named_speculation():
    """A replay with another speculation (its counters differ, its token does not) was said to be "sampling: ...
    another token": the cause names the draft."""
    from toolkit.trace.diverge import REPLAYED_FIELDS

    a = sequences([row("r", 0, 1, spec_proposed=0, spec_accepted=0)])
    b = sequences([row("r", 0, 1, spec_proposed=1, spec_accepted=0)])
    (d,) = first_divergences(a, b, REPLAYED_FIELDS)
    assert d.kind == "speculation" and d.fields == ("spec_proposed",), d
    assert "(cause: speculation: the same token, another draft" in d.describe("recorded", "replayed")


def test_a_sampling_policy_that_differs_is_named_with_its_values():
    """Two runs at another temperature were explained as "sampling noise: ... other Gumbel noise": the rows record
    their policy, and a policy no stage explains is the cause, named with both values. Another seed is still the
    noise it draws, another top_k still the kept set, each saying the policy differs too."""
    policy = {"temperature": 0.699999988079071, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "seed": 7}
    policy["processors"] = ["temperature(0.7)", "gumbel_max"]
    a = sequences([row("r", 0, 1, **policy), row("r", 1, 2, **policy)])
    hotter = {**policy, "temperature": 1.2999999523162842, "processors": ["temperature(1.3)", "gumbel_max"]}
    b = sequences([row("r", 0, 1, **hotter), row("r", 1, 3, noise=0.25, **hotter)])
    (d,) = first_divergences(a, b)
    assert (d.position, d.kind) == (1, "policy"), d
    assert d.cause == "sampling policy: temperature 0.7 vs 1.3; the same logits, sampled under another policy"
    assert d.describe().endswith(
        "(cause: sampling policy: temperature 0.7 vs 1.3; the same logits, sampled under another policy)"
    )
    reseeded = sequences([row("r", 0, 1, **{**policy, "seed": 8}), row("r", 1, 3, noise=0.25, **{**policy, "seed": 8})])
    (d,) = first_divergences(a, reseeded)
    assert d.kind == "noise" and d.cause.endswith("; the sampling policy differs too: seed 7 vs 8"), d.cause
    top_k = {**policy, "top_k": 5, "processors": ["temperature(0.7)", "top_k(5)", "gumbel_max"]}
    cut = sequences([row("r", 0, 1, **top_k), row("r", 1, 2, kept_sha256="other", **top_k)])
    (d,) = first_divergences(a, cut)
    assert d.kind == "support" and "the sampling policy differs too: top_k -1 vs 5" in d.cause, d.cause
    # the raw logits no policy changes: a numerical divergence stays one
    (d,) = first_divergences(a, sequences([row("r", 0, 1, **hotter), row("r", 1, 2, logits_sha256="x", **hotter)]))
    assert d.kind == "logits"


def test_a_request_whose_prompts_differ_is_named_so_not_by_its_rows():
    """Two runs whose request "b" had another prompt of the same length: its rows part at the logits, which read as
    "numerical: the forward computed other bits"; with each run's prompts given, the prompt is the cause. A request
    with one prompt in both runs keeps its row-level cause."""
    a = sequences([row("b", 5, 1), row("same", 5, 1)])
    b = sequences([row("b", 5, 1, logits_sha256="other"), row("same", 5, 1, logits_sha256="other")])
    prompts = ({"b": [1, 2, 3], "same": [4, 5]}, {"b": [1, 2, 9], "same": [4, 5]})
    by_request = {d.request_id: d for d in first_divergences(a, b, prompts=prompts)}
    assert by_request["b"].kind == "prompt" and by_request["b"].cause.startswith("prompt: the two runs' prompts differ")
    assert by_request["same"].kind == "logits"
    assert {d.kind for d in first_divergences(a, b)} == {"logits"}  # without the prompts: what the rows say
