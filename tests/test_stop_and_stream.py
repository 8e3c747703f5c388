"""Stop strings across token boundaries, streaming that never leaks a stop string, n > 1."""

from __future__ import annotations

import pytest

from tests.conftest import make_engine
from toolkit.config import SamplingParams
from toolkit.stop import StopState, held_back, update_text

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def feed(tokenizer, ids, stops, include=False):
    state, shown, hit = StopState(), "", None
    for n in range(1, len(ids) + 1):
        u = update_text(tokenizer.decode, ids[:n], stops, state, check_stops=True, include_stop=include, final=False)
        shown += u.delta
        if u.stop_string:
            return shown, u.stop_string, n, u.text
    return shown, hit, len(ids), None


@pytest.mark.parametrize("text, stop", [
    ("The answer is 42.\n\nUser: next question", "\n\nUser:"),
    ("alpha beta gamma delta epsilon", "gamma del"),
    ("Il était une fois un château", "château"),
])
def test_stop_string_split_across_tokens_is_caught(tiny, text, stop):
    tok = tiny.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode(ids[:i + 1]) for i in range(len(ids))]
    start = text.index(stop)
    first = next(i for i, p in enumerate(pieces) if len(p) > start)
    last = next(i for i, p in enumerate(pieces) if len(p) >= start + len(stop))
    assert last > first, "the stop string must span at least two tokens for this case"
    shown, hit, n, final = feed(tok, ids, [stop])
    assert hit == stop and n == last + 1
    assert shown == final == text[:start]
    shown, hit, n, final = feed(tok, ids, [stop], include=True)
    assert final == text[:start + len(stop)] and shown == final


def test_streamed_text_never_shows_a_stop_prefix_that_later_completes(tiny):
    tok = tiny.tokenizer
    text = "one two three four five six"
    ids = tok.encode(text, add_special_tokens=False)
    stop = "four fi"
    state = StopState()
    for n in range(1, len(ids) + 1):
        u = update_text(tok.decode, ids[:n], [stop], state, check_stops=True, include_stop=False, final=False)
        shown = u.text[: state.emitted]
        assert "four" not in shown and not shown.endswith("fo")
        if u.stop_string:
            break
    assert held_back("abc four f", [stop]) == len("four f")
    assert held_back("abc", [stop]) == 0


def test_engine_stop_string_and_stream_deltas(tiny):
    engine = make_engine(tiny)
    base = engine.generate([{"prompt_token_ids": [10, 20, 30], "sampling_params": GREEDY}])[0]
    text = base.text
    stop = text[len(text) // 2: len(text) // 2 + 4]
    assert len(stop) == 4 and stop.strip()
    engine = make_engine(tiny)
    deltas = list(engine.stream([{"prompt_token_ids": [10, 20, 30], "request_id": "s",
                                  "sampling_params": GREEDY.replace(stop=[stop])}]))
    out = engine.output("s")
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert "".join(d.text for d in deltas) == out.text
    assert deltas[-1].finished and sum(d.finished for d in deltas) == 1
    assert list(out.output_token_ids) == list(base.output_token_ids[: len(out.output_token_ids)])


def test_parallel_samples_use_their_own_streams(tiny):
    engine = make_engine(tiny)
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    out = engine.generate([{"prompt_token_ids": [1, 2, 3, 4], "sampling_params": params, "request_id": "p"}])[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({c.token_ids for c in out.outputs}) == 3
    again = make_engine(tiny).generate([{"prompt_token_ids": [1, 2, 3, 4], "sampling_params": params}])[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    single = make_engine(tiny).generate([{"prompt_token_ids": [1, 2, 3, 4],
                                          "sampling_params": params.replace(n=1)}])[0]
    assert single.output_token_ids == out.outputs[0].token_ids  # stream 0 is the n=1 sample


def test_min_tokens_delays_eos_and_stop_strings(tiny):
    eos = 2
    engine = make_engine(tiny)
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=5, logit_bias={eos: 50.0})
    out = engine.generate([{"prompt_token_ids": [5, 6], "sampling_params": params}])[0]
    assert out.output_token_ids[:4] != (eos,) * 4 and eos not in out.output_token_ids[:5]
    assert out.output_token_ids[5] == eos and out.finish_reason == "stop" and len(out.output_token_ids) == 6
