"""A foreign transcript's token strings mapped to ids exactly, or reported: never mapped to another token.

Servers print tokens as strings; some strip a leading space, every one prints a piece of a multi-byte character as
U+FFFD. The mapped tokens must spell the response's text (toolkit.audit.spelling), and a prompt rebuilt here is
confirmed by the response's count or reported. The transcripts are built from real text through SmolLM2's
tokenizer, with the logprobs the reference itself computes, so the only thing that can be wrong is the mapping.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from toolkit.audit.checks import audit_transcripts
from toolkit.audit.records import TokenMap
from toolkit.audit.transcripts import read_transcripts
from toolkit.reproduce.verify import reference_forward

MESSAGES = [{"role": "user", "content": "Tell me something."}]
ANSWERS = (
    "The café on the corner opens at nine, and the naïve tourists queue early.",
    "Sure! Here is a list:\n- apples\n- pears  (two spaces)\n- 日本語のテキスト 🙂 and back to English.",
    "Numbers like 3.14159, 2,718 and -42 mix with symbols: <tag> & 100% ... done",
)


@pytest.fixture(scope="module")
def token_map(tiny):
    return TokenMap(tiny.tokenizer, tiny.arch.vocab_size)


def _line(
    tiny,
    text: str,
    *,
    strip: bool = False,
    with_bytes: bool = False,
    claimed=None,
    usage: bool = True,
    finish_reason: str = "length",
    empty_pieces: bool = False,
    top=None,
    cut: int | None = None,
) -> dict:
    """A chat completion whose answer is `text` (tokenized by SmolLM2's tokenizer), its entries printed as a server
    prints them: each token's bytes decoded with U+FFFD for a partial character (or, `empty_pieces`, as ""),
    optionally with the leading space stripped (and no `bytes`), or with `bytes`."""
    tok = tiny.tokenizer
    ids = tok.encode(text, add_special_tokens=False)[:cut]  # `cut`: the response's first tokens, maybe mid-character
    raw = tok.token_bytes(tiny.arch.vocab_size)

    def printed(i: int) -> str:
        token = raw[i].decode("utf-8", errors="replace")
        token = "" if empty_pieces and "\ufffd" in token else token
        return token.lstrip(" ") if strip else token

    entries = []
    for j, i in enumerate(ids):
        entry = {"token": printed(i), "logprob": claimed[j] if claimed else -1.0}
        if with_bytes:
            entry["bytes"] = list(raw[i])
        if top:
            entry["top_logprobs"] = [{"token": printed(a), "logprob": lp} for a, lp in top[j]]
        entries.append(entry)
    response = {
        "id": "chat-1",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": tok.decode(ids)},
                "finish_reason": finish_reason,
                "logprobs": {"content": entries},
            }
        ],
    }
    if usage:
        response["usage"] = {"prompt_tokens": len(tok.apply_chat_template(MESSAGES)), "completion_tokens": len(ids)}
    return {
        "request": {"model": "m", "messages": MESSAGES, "logprobs": True},  # no policy: not a greedy claim
        "response": response,
    }


def _read(tmp_path, tiny, lines):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return read_transcripts(path, "openai", tiny.tokenizer, tiny.arch.vocab_size)


def _claims(tiny, text: str, k: int = 3) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """The reference's own raw logprobs of the answer's tokens and its top `k` alternatives at each (a transcript
    the model could have written)."""
    prompt = tiny.tokenizer.apply_chat_template(MESSAGES)
    ids = tiny.tokenizer.encode(text, add_special_tokens=False)
    logits = reference_forward(tiny, "ours")(prompt + ids[:-1])[len(prompt) - 1 :]
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    top = torch.topk(logprobs, k, dim=-1)
    return (
        [float(logprobs[j, t]) for j, t in enumerate(ids)],
        [list(zip(i.tolist(), v.tolist())) for i, v in zip(top.indices, top.values)],
    )


@settings(max_examples=40, deadline=None)
@given(
    st.text(
        alphabet=st.sampled_from(list("ab xyz.,!\n\t") + ["é", "ï", "日", "本", "語", "🙂", "—", "€"]),
        min_size=1,
        max_size=40,
    )
)
@example(" 本")  # stripped, " " prints as "", which the token " \xe6" (its space and 本's first byte) also spells
def test_mapped_tokens_are_the_true_ones_or_reported(tiny, token_map, tmp_path_factory, text):
    """Whatever the text: every mapped token is the one the server sampled, and a token the strings cannot name
    for sure is reported as unmapped (with U+FFFD pieces, the text decides them where one choice spells it)."""
    ids = tiny.tokenizer.encode(text, add_special_tokens=False)
    for strip, empty in ((False, False), (True, False), (False, True)):
        records, errors = _read(
            tmp_path_factory.mktemp("m"), tiny, [_line(tiny, text, strip=strip, empty_pieces=empty)]
        )
        assert not errors, errors
        record = records[0]
        got = record.output_token_ids
        assert got == ids[: len(got)]  # never another token
        assert all(p.kind == "unmapped_token" and p.why for p in record.problems)
        if not record.problems:
            assert got == ids
        elif not strip:  # with the exact strings only a piece of a character that the text cannot decide stops it
            assert "multi-byte" in record.problems[0].why


@settings(max_examples=40, deadline=None)
@given(
    st.text(alphabet=st.sampled_from(list("ab .") + ["é", "日", "本", "🙂", "🙃", "—", "€"]), min_size=1, max_size=24),
    st.integers(1, 30),
)
@example("Emoji 🙂", 3)
def test_a_response_cut_inside_a_character_never_maps_its_u_fffd_to_a_token(tiny, tmp_path_factory, text, cut):
    """A response ending inside a character (max_tokens) has text ending in U+FFFD, the server's rendering of the
    bytes it could not decode; its last token prints as U+FFFD too. Those bytes are no token's: the piece was
    mapped to the token U+FFFD itself (or two that spell its bytes) and flagged 10-23 nats off as a greedy
    departure. Every mapped token is the true one; the rest are reported as unmapped."""
    ids = tiny.tokenizer.encode(text, add_special_tokens=False)[:cut]
    records, errors = _read(tmp_path_factory.mktemp("cut"), tiny, [_line(tiny, text, cut=cut)])
    assert not errors, errors
    got = records[0].output_token_ids
    assert got == ids[: len(got)]  # never another token
    assert all(p.kind == "unmapped_token" for p in records[0].problems)


def test_pieces_of_characters_are_recovered_from_the_text(tiny, tmp_path):
    text = "Emoji 🙂🙃 and 日本語 and naïve"
    ids = tiny.tokenizer.encode(text, add_special_tokens=False)
    raw = tiny.tokenizer.token_bytes(tiny.arch.vocab_size)
    assert any("\ufffd" in raw[i].decode("utf-8", errors="replace") for i in ids)  # the case under test occurs
    records, errors = _read(tmp_path, tiny, [_line(tiny, text), _line(tiny, text, with_bytes=True)])
    assert not errors and [r.output_token_ids for r in records] == [ids, ids]
    assert not records[0].problems


def test_a_server_that_strips_spaces_gets_no_false_logprob_flag(tiny, tmp_path):
    """Stripped token strings each map to a valid token (' the' -> 'the'); without the text check the audit would
    recompute the wrong tokens and flag their logprobs. Here: the untouched transcript audits clean, and the
    stripped one flags nothing but unmapped tokens, each at a token whose string lost its space."""
    lines, stripped = [], []
    for text in ANSWERS:
        claimed, top = _claims(tiny, text)
        lines.append(_line(tiny, text, claimed=claimed, top=top))
        stripped.append(_line(tiny, text, claimed=claimed, top=top, strip=True))
    forward = reference_forward(tiny, "ours")
    records, errors = _read(tmp_path, tiny, lines)
    clean = audit_transcripts(records, forward, tiny, atol=1e-4, reference="ours", line_errors=errors).to_dict()
    assert clean["passed"] and clean["tokens"] == sum(
        len(tiny.tokenizer.encode(t, add_special_tokens=False)) for t in ANSWERS
    ), clean["requests"]
    assert clean["kl_tokens"] == clean["tokens"]  # the alternatives were checked too
    records, errors = _read(tmp_path, tiny, stripped)
    report = audit_transcripts(records, forward, tiny, atol=1e-4, reference="ours", line_errors=errors).to_dict()
    raw = tiny.tokenizer.token_bytes(tiny.arch.vocab_size)
    prompt_len = len(tiny.tokenizer.apply_chat_template(MESSAGES))
    for text, rep in zip(ANSWERS, report["requests"]):
        ids = tiny.tokenizer.encode(text, add_special_tokens=False)
        spaced = [prompt_len + j for j, i in enumerate(ids) if raw[i].startswith(b" ")]
        flagged = rep["flagged"]
        assert {f["kind"] for f in flagged} == {"unmapped_token"}, flagged  # no logprob (or top_logprob) flag
        positions = [f["position"] for f in flagged]
        if "not recovered" in flagged[-1]["why"]:  # a stripped piece of a character: the scan stops there
            spaced = [p for p in spaced if p <= positions[-1]]
        assert positions == spaced  # every stripped token, and only those
        assert "not audited" in flagged[0]["why"]
        assert any("differ from its text" in f["why"] for f in flagged)  # a valid token, not the text's
        assert rep["tokens"] == spaced[0] - prompt_len  # the tokens before the first are audited


def test_text_missing_tokens_and_a_trimmed_stop_string(tiny, token_map, tmp_path):
    text = "One line. Then another."
    ids = tiny.tokenizer.encode(text, add_special_tokens=False)
    short = _line(tiny, text)
    short["response"]["choices"][0]["logprobs"]["content"].pop()  # the last token's entry lost
    stop = _line(tiny, text, finish_reason="stop")
    stop["response"]["choices"][0]["message"]["content"] = tiny.tokenizer.decode(ids)[:-1]  # "." cut as a stop string
    records, errors = _read(tmp_path, tiny, [short, stop])
    assert not errors
    assert records[0].problems[0].kind == "unmapped_token" and "missing" in records[0].problems[0].why
    assert records[1].output_token_ids == ids and not records[1].problems
    no_text = _line(tiny, text)
    no_text["response"]["choices"][0]["message"]["content"] = None
    records, _ = _read(tmp_path, tiny, [no_text])
    assert records[0].output_token_ids == [] and "no text" in records[0].problems[0].why


def test_prompts_rebuilt_are_confirmed_or_refused(tiny, tmp_path):
    text = "Hello there."
    unconfirmed = _line(tiny, text, usage=False)
    miscounted = _line(tiny, text)
    miscounted["response"]["usage"]["prompt_tokens"] += 1
    named = _line(tiny, text)
    named["request"]["messages"] = [{"role": "user", "content": "Tell me something.", "name": "ann"}]
    tools = _line(tiny, text)
    tools["request"]["tools"] = [{"type": "function", "function": {"name": "f"}}]
    defaults = _line(tiny, text)  # fields at their no-op values change nothing
    defaults["request"].update(add_generation_prompt=True, tools=[], continue_final_message=False)
    defaults["request"]["messages"] = [{**MESSAGES[0], "name": None, "tool_calls": []}]
    given = _line(tiny, text, usage=False)
    given["response"]["prompt_token_ids"] = tiny.tokenizer.apply_chat_template(MESSAGES)
    records, errors = _read(tmp_path, tiny, [unconfirmed, miscounted, named, tools, defaults, given])
    assert [(e.line, e.why.split(" ")[0]) for e in errors] == [
        (2, "usage.prompt_tokens"),
        (3, "request.messages[0].name"),
        (4, "request.tools"),
    ]
    first, middle, last = records
    assert middle.prompt_source == "rebuilt" and not middle.problems and len(middle.output_token_ids) > 0
    assert first.prompt_source == "rebuilt" and first.output_token_ids == []
    assert [p.kind for p in first.problems] == ["unconfirmed_prompt"] and "not audited" in first.problems[0].why
    assert last.prompt_source == "given" and not last.problems and len(last.output_token_ids) > 0


def test_id_names_a_token_ids_request(tiny, tmp_path):
    path = tmp_path / "ids.jsonl"
    rows = [
        {"id": "rollout-7", "prompt_token_ids": [1, 2, 3], "output_token_ids": [4], "logprobs": [-1.0]},
        {"request_id": "r-8", "id": "ignored", "prompt_token_ids": [1, 2], "output_token_ids": [5], "logprobs": [-1.0]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records, errors = read_transcripts(path, "token_ids", tiny.tokenizer, tiny.arch.vocab_size)
    assert not errors and [r.request_id for r in records] == ["rollout-7", "r-8"]


def test_a_choice_with_unmapped_tokens_leaves_its_sibling_choices_intact(tiny, tmp_path):
    """n=2: the first choice's strings lost their spaces (reported), the second's are exact. The second is still
    stream 1 of the same request and fully mapped (a loop over the first's problems once rebound `n`)."""
    text = "Hello world."  # one token with a space: one problem in the first choice
    ids = tiny.tokenizer.encode(text, add_special_tokens=False)
    line = _line(tiny, text, strip=True)
    second = _line(tiny, text)["response"]["choices"][0]
    line["response"]["choices"].append({**second, "index": 1})
    line["request"]["n"] = 2
    line["response"]["usage"]["completion_tokens"] *= 2
    records, errors = _read(tmp_path, tiny, [line])
    assert not errors, errors
    assert [(r.request_id, r.stream) for r in records] == [("chat-1", 0), ("chat-1", 1)]
    assert records[0].problems and records[0].problems[0].kind == "unmapped_token"
    assert records[1].output_token_ids == ids and not records[1].problems


@pytest.fixture(scope="module")
def pieces(token_map):
    """Ids of tokens whose bytes are no whole UTF-8 (a character's first byte, or its last ones)."""
    found = []
    for i, b in enumerate(token_map.bytes_of):
        try:
            b.decode("utf-8")
        except UnicodeDecodeError:
            found.append(i)
    return found[:64]


@settings(max_examples=30, deadline=None)
@given(data=st.data())
@example(data=None)  # our server's answer where it was found: a lone first byte (b"\xc5"), then " i"
def test_tokens_that_are_no_utf8_are_confirmed_by_the_text_they_decode_to(
    tiny, token_map, pieces, tmp_path_factory, data
):
    """A sampled sequence need not be UTF-8: a character's first byte followed by a space, say. A server's text has
    U+FFFD there; with each token's `bytes` given, those tokens are confirmed by that text, never reported
    unmapped (they were, as a string differing from the text: a false flag on our own server's transcript)."""
    tok = tiny.tokenizer
    if data is None:
        ids = tok.encode("Hello", add_special_tokens=False) + [144] + tok.encode(" it is", add_special_tokens=False)
        assert not _whole(token_map.bytes_of[144])
    else:
        plain = st.integers(0, tiny.arch.vocab_size - 1).filter(lambda i: i not in token_map.special_ids)
        ids = data.draw(st.lists(plain | st.sampled_from(pieces), min_size=1, max_size=10))
    raw = token_map.bytes_of
    entries = [{"token": raw[i].decode("utf-8", errors="replace"), "bytes": list(raw[i]), "logprob": -1.0} for i in ids]
    text = b"".join(raw[i] for i in ids).decode("utf-8", errors="replace")
    assert text == tok.decode(ids)  # what a server prints: the tokenizer's own decode
    usage = {"prompt_tokens": len(tok.apply_chat_template(MESSAGES)), "completion_tokens": len(ids)}
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": {"content": entries}}
    line = {
        "request": {"model": "m", "messages": MESSAGES, "logprobs": True},
        "response": {"id": "chat-1", "choices": [{**choice, "finish_reason": "length"}], "usage": usage},
    }
    records, errors = _read(tmp_path_factory.mktemp("u"), tiny, [line])
    assert not errors and not records[0].problems, (errors, records[0].problems)
    assert records[0].output_token_ids == ids


def _whole(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
