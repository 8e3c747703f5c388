"""Stop strings across token boundaries, streaming that never leaks a stop string, n > 1."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import make_engine
from toolkit.sampling.params import SamplingParams
from toolkit.sampling.stop import REPLACEMENT, StopState, held_back, update_text

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def feed(tokenizer, ids, stops, include=False):
    state, shown, hit = StopState(), "", None
    for n in range(1, len(ids) + 1):
        u = update_text(tokenizer.decode, ids[:n], stops, state, check_stops=True, include_stop=include, final=False)
        shown += u.delta
        if u.stop_string:
            return shown, u.stop_string, n, state.text
    return shown, hit, len(ids), None


@pytest.mark.parametrize(
    "text, stop",
    [
        ("The answer is 42.\n\nUser: next question", "\n\nUser:"),
        ("alpha beta gamma delta epsilon", "gamma del"),
        ("Il était une fois un château", "château"),
    ],
)
def test_stop_string_split_across_tokens_is_caught(tiny, text, stop):
    tok = tiny.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode(ids[: i + 1]) for i in range(len(ids))]
    start = text.index(stop)
    first = next(i for i, p in enumerate(pieces) if len(p) > start)
    last = next(i for i, p in enumerate(pieces) if len(p) >= start + len(stop))
    assert last > first, "the stop string must span at least two tokens for this case"
    shown, hit, n, final = feed(tok, ids, [stop])
    assert hit == stop and n == last + 1
    assert shown == final == text[:start]
    shown, hit, n, final = feed(tok, ids, [stop], include=True)
    assert final == text[: start + len(stop)] and shown == final


def test_streamed_text_never_shows_a_stop_prefix_that_later_completes(tiny):
    tok = tiny.tokenizer
    text = "one two three four five six"
    ids = tok.encode(text, add_special_tokens=False)
    stop = "four fi"
    state = StopState()
    for n in range(1, len(ids) + 1):
        u = update_text(tok.decode, ids[:n], [stop], state, check_stops=True, include_stop=False, final=False)
        shown = state.text[: state.emitted]
        assert "four" not in shown and not shown.endswith("fo")
        if u.stop_string:
            break
    assert held_back("abc four f", [stop]) == len("four f")
    assert held_back("abc", [stop]) == 0


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.text("ab", min_size=1, max_size=7), min_size=1, max_size=4),
    st.lists(st.text("abc", max_size=6), max_size=30),
)
def test_the_incremental_prefix_matcher_holds_back_what_the_quadratic_scan_does(stops, chunks):
    """The held-back length carried from token to token (PrefixMatcher, KMP) equals held_back's scan of the whole
    text after every chunk, over a two-letter alphabet where prefixes overlap the most."""
    from toolkit.sampling.stop import PrefixMatcher

    matcher, text = PrefixMatcher(stops), ""
    for chunk in chunks:
        matcher.feed(chunk)
        text += chunk
        assert matcher.held() == held_back(text, stops), (text, stops)


def test_holding_back_a_long_stop_string_costs_no_more_per_token_as_the_text_grows(tiny):
    """One stop string at the server's bound (4,096 characters) that the text keeps almost matching: the held-back
    work per update reads the new characters only (counted: the matcher's characters fed equal the text's)."""
    from toolkit.sampling.stop import PrefixMatcher

    stop = "e" * 4095 + "Z"
    fed = []
    original = PrefixMatcher.feed

    def counting(self, text):
        fed.append(len(text))
        return original(self, text)

    PrefixMatcher.feed = counting
    try:
        state, ids = StopState(), tiny.tokenizer.encode("e" * 3000 + " fin!", add_special_tokens=False)
        for n in range(1, len(ids) + 1):
            update_text(
                tiny.tokenizer.decode, ids[:n], [stop], state, check_stops=True, include_stop=False, final=False
            )
    finally:
        PrefixMatcher.feed = original
    assert sum(fed) == len(state.text.rstrip(REPLACEMENT))  # each character read once
    assert state.emitted == len(state.text) and state.text.endswith(" fin!")  # nothing held back at the end


@pytest.mark.native
def test_engine_stop_string_and_stream_deltas(tiny):
    engine = make_engine(tiny)
    base = engine.generate([{"prompt_token_ids": [10, 20, 30], "sampling_params": GREEDY}])[0]
    text = base.text
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    assert len(stop) == 4 and stop.strip()
    engine = make_engine(tiny)
    deltas = list(
        engine.stream(
            [{"prompt_token_ids": [10, 20, 30], "request_id": "s", "sampling_params": GREEDY.replace(stop=[stop])}]
        )
    )
    out = engine.output("s")
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert "".join(d.text for d in deltas) == out.text
    assert deltas[-1].finished and sum(d.finished for d in deltas) == 1
    assert list(out.output_token_ids) == list(base.output_token_ids[: len(out.output_token_ids)])


@pytest.mark.native
def test_parallel_samples_use_their_own_streams(tiny):
    engine = make_engine(tiny)
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    out = engine.generate([{"prompt_token_ids": [1, 2, 3, 4], "sampling_params": params, "request_id": "p"}])[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({c.token_ids for c in out.outputs}) == 3
    again = make_engine(tiny).generate([{"prompt_token_ids": [1, 2, 3, 4], "sampling_params": params}])[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    single = make_engine(tiny).generate([{"prompt_token_ids": [1, 2, 3, 4], "sampling_params": params.replace(n=1)}])[0]
    assert single.output_token_ids == out.outputs[0].token_ids  # stream 0 is the n=1 sample


@pytest.mark.native
def test_min_tokens_delays_eos_and_stop_strings(tiny):
    eos = 2
    engine = make_engine(tiny)
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=5, logit_bias={eos: 50.0})
    out = engine.generate([{"prompt_token_ids": [5, 6], "sampling_params": params}])[0]
    assert out.output_token_ids[:4] != (eos,) * 4 and eos not in out.output_token_ids[:5]
    assert out.output_token_ids[5] == eos and out.finish_reason == "stop" and len(out.output_token_ids) == 6


# ------------------------------------------------------------------ incremental == full re-decode


def full_redecode(decode, output_ids, stops, state, *, check_stops, include_stop, final):
    """The matcher as it was before incremental detokenization: the whole output decoded every token
    (O(n^2) per sequence). The oracle the incremental one must agree with; `state` is a plain dict."""
    text = decode(output_ids)
    if check_stops and stops:
        start = max(0, state["scanned"] - max(len(s) for s in stops) + 1)
        end = len(text) if final else len(text.rstrip(REPLACEMENT))  # not into a character still incomplete
        hits = [(pos, s) for s in stops if (pos := text.find(s, start, end)) >= 0]
        if hits:
            pos, s = min(hits)
            text = text[: pos + len(s)] if include_stop else text[:pos]
            delta = text[state["emitted"] :]
            state["emitted"] = state["scanned"] = len(text)
            return delta, s, text
    stable = len(text)
    if not final:
        while stable and text[stable - 1] == REPLACEMENT:
            stable -= 1
        if check_stops and stops:
            stable -= held_back(text[:stable], stops)
    state["scanned"] = len(text.rstrip(REPLACEMENT)) if not final else len(text)
    stable = max(stable, state["emitted"])
    delta = text[state["emitted"] : stable]
    state["emitted"] = stable
    return delta, None, text


# texts whose characters take 1 to 4 UTF-8 bytes, so byte-level tokens split characters
MULTIBYTE = st.text(
    alphabet=st.sampled_from(list("ab c.\n") + ["é", "ß", "€", "中", "文", "😀", "🚀", "\u0301"]),
    min_size=1,
    max_size=40,
)


def _byte_tokens(tokenizer) -> list[int]:
    """Ids of SmolLM2's single-byte tokens for bytes 0x80-0xFF (continuation and lead bytes)."""
    byte_map = {
        0x80 + i: ch
        for i, ch in enumerate(
            "ĢģĤĥĦħĨĩĪīĬĭĮįİıĲĳĴĵĶķĸĹĺĻļĽľĿŀŁł¡¢£¤¥¦§¨©ª«¬Ń®¯°±²³´µ¶·¸¹º»¼½¾¿ÀÁÂÃÄÅÆÇÈÉÊËÌÍÎÏÐÑÒÓÔÕÖ×ØÙÚÛÜÝÞßàáâãäåæçèéêëìíîïðñòóôõö÷øùúûüýþÿ"
        )
    }
    ids = [tokenizer._tok.token_to_id(ch) for ch in byte_map.values()]
    return [i for i in ids if i is not None]


@settings(max_examples=150, deadline=None)
@given(data=st.data(), text=MULTIBYTE, include=st.booleans(), min_tokens=st.integers(0, 4), skip_special=st.booleans())
def test_incremental_detokenization_equals_a_full_redecode(tiny, data, text, include, min_tokens, skip_special):
    """Token by token, the incremental matcher streams the same deltas, finds the same stop string at
    the same token and ends with the same text as decoding the whole output each time: on real
    SmolLM2 ids of multi-byte text, with random single-byte tokens (partial and invalid UTF-8) and
    special tokens mixed in, and stop strings cut from the text so they span tokens."""
    tok = tiny.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    extra = st.sampled_from(_byte_tokens(tok) + [tok.eos_token_id, 0, 1, 2])
    for _ in range(data.draw(st.integers(0, 4))):
        ids.insert(data.draw(st.integers(0, len(ids))), data.draw(extra))
    full = tok.decode(ids, skip_special_tokens=skip_special)
    stops = []
    for _ in range(data.draw(st.integers(0, 3))):
        a = data.draw(st.integers(0, max(0, len(full) - 1)))
        piece = full[a : a + data.draw(st.integers(1, 6))]
        if piece:
            stops.append(piece)
    if data.draw(st.booleans()):
        stops.append(data.draw(st.text(min_size=1, max_size=4)))
    decode = lambda xs: tok.decode(xs, skip_special_tokens=skip_special)  # noqa: E731
    prompt = [5, 6, 7]  # the output follows a prompt in the sequence's token list
    state, oracle = StopState(), {"emitted": 0, "scanned": 0}
    for n in range(1, len(ids) + 1):
        final = n == len(ids)
        kwargs = dict(check_stops=n >= min_tokens, include_stop=include, final=final)
        got = update_text(decode, prompt + ids[:n], stops, state, first=len(prompt), **kwargs)
        delta, hit, want_text = full_redecode(decode, ids[:n], stops, oracle, **kwargs)
        assert (got.delta, got.stop_string) == (delta, hit), n
        assert (state.emitted, state.scanned) == (oracle["emitted"], oracle["scanned"]), n
        assert state.text == want_text, n
        if hit:
            break


@pytest.mark.parametrize("stops", [[], ["zebra"]])
def test_text_streamed_past_an_invalid_byte_is_neither_repeated_nor_lost(tiny, stops):
    """SmolLM2 ids for ".", a lone continuation byte (U+FFFD for good), " " with the lead byte of 文, then its two
    continuation bytes, one token each. The stream may show " " while 文 is still incomplete: the text streamed
    is then past the confirmed text, inside the pending one. Streaming from there once repeated the " " and lost
    文 (".\ufffd  " instead of ".\ufffd 文"): the pending text was read as if it began at the stream point."""
    tok = tiny.tokenizer
    ids = [30, 221, 17097, 240, 225]
    assert tok.decode(ids) == ".\ufffd 文"
    state, oracle, streamed = StopState(), {"emitted": 0, "scanned": 0}, []
    for n in range(1, len(ids) + 1):
        kwargs = dict(check_stops=True, include_stop=False, final=n == len(ids))
        got = update_text(tok.decode, ids[:n], stops, state, **kwargs)
        assert got.delta == full_redecode(tok.decode, ids[:n], stops, oracle, **kwargs)[0], n
        streamed.append(got.delta)
    assert "".join(streamed) == tok.decode(ids)


def test_characters_split_across_tokens_come_out_whole(tiny):
    """Decoding each token alone would split multi-byte characters into U+FFFD; the matcher holds a
    partial character back until the token that completes it."""
    tok = tiny.tokenizer
    ids = tok.encode("中文 😀 é", add_special_tokens=False)
    naive = "".join(tok.decode([i]) for i in ids)
    assert naive != tok.decode(ids) and REPLACEMENT in naive
    state = StopState()
    for n in range(1, len(ids) + 1):
        update_text(tok.decode, ids[:n], [], state, check_stops=False, include_stop=False, final=n == len(ids))
    assert state.text == tok.decode(ids)


@pytest.mark.parametrize("stop", [REPLACEMENT, "😀" + REPLACEMENT])
def test_a_stop_string_holding_u_fffd_never_matches_a_character_still_incomplete(tiny, stop):
    """A partial character decodes as U+FFFD until the token that completes it: a stop string holding U+FFFD matched
    it, and the text was cut at an emoji's first bytes (the probe's "Write three emojis" with stop ["\ufffd"])."""
    tok = tiny.tokenizer
    ids = tok.encode("1. 😀😀😀 done", add_special_tokens=False)
    assert REPLACEMENT in "".join(tok.decode(ids[:n]) for n in range(1, len(ids)))  # characters split over tokens
    for include in (False, True):
        shown, hit, n, final = feed(tok, ids, [stop], include=include)
        assert hit is None and shown == tok.decode(ids)[: len(shown)], (stop, include, shown)


def test_work_per_token_does_not_grow_with_the_output(tiny):
    """Each update decodes only the tokens since the last confirmed character (plus context), so the
    tokens handed to decode per update stay bounded over a 3,000-token output."""
    tok = tiny.tokenizer
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 300, add_special_tokens=False)[:3000]
    seen = []

    def decode(xs):
        seen.append(len(xs))
        return tok.decode(xs)

    state = StopState()
    for n in range(1, len(ids) + 1):
        update_text(decode, ids[:n], ["zebra!"], state, check_stops=True, include_stop=False, final=False)
    assert max(seen) <= 4, max(seen)
    assert state.text == tok.decode(ids)
