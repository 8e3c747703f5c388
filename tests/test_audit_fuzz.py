"""Transcripts other engines wrote, broken one value at a time: every line is audited or refused with its line
number and a reason that names the field, never an exception out of the audit, never an allocation the line's
size does not bound. The seeds are real transcripts in every format the audit reads (HF generate; vLLM's and
SGLang's token-id shapes; our server's chat and completions answers through the openai client, whole and
streamed); a mutation replaces a value somewhere in a line with a hostile one, deletes it, or repeats it."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from tests.conftest import make_engine
from toolkit.audit.checks import audit_transcripts
from toolkit.audit.foreign import write_converted_trace
from toolkit.audit.sources import hf_transcript
from toolkit.audit.transcripts import read_transcripts
from toolkit.reproduce.verify import reference_forward
from toolkit.sampling.params import SamplingParams
from toolkit.serve.main import start_server

pytestmark = pytest.mark.native

HOSTILE = (
    None,
    True,
    0,
    -1,
    2**63,
    -(2**70),
    1e308,
    float("nan"),
    float("inf"),
    float("-inf"),
    0.5,
    "",
    "x",
    "\ud800",
    "NaN",
    "<|im_end|>",
    [],
    [None],
    [[]],
    {},
    {"a": 1},
    [10**9],
    [-5],
    10**9,
    49152,
)


def _vllm_and_sglang(hf_lines: list[dict]) -> list[dict]:
    out = []
    for o in hf_lines:
        entries = []
        for t, lp, top in zip(o["output_token_ids"], o["logprobs"], o["top_logprobs"]):
            d = {str(a["token_id"]): {"logprob": a["logprob"], "rank": r + 1} for r, a in enumerate(top)}
            d[str(t)] = {"logprob": lp, "rank": None}
            entries.append(d)
        out.append({"prompt_token_ids": o["prompt_token_ids"], "output_token_ids": o["output_token_ids"]})
        out[-1].update(logprobs=entries, request_id=o["request_id"], origin_engine="vllm", finish_reason="length")
        steps = [[lp, t, None] for t, lp in zip(o["output_token_ids"], o["logprobs"])]
        tops = [[[a["logprob"], a["token_id"], None] for a in top] for top in o["top_logprobs"]]
        meta = {"id": o["request_id"], "output_token_logprobs": steps, "output_top_logprobs": tops}
        meta["finish_reason"] = {"type": "length"}
        out.append({"prompt_token_ids": o["prompt_token_ids"], "meta_info": meta})
    return out


def _openai(tiny) -> list[dict]:
    import openai

    server = start_server(make_engine(tiny, sampling=SamplingParams()), None)
    lines = []
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        chat = {"messages": [{"role": "user", "content": "Say hi 🙂"}], "logprobs": True, "top_logprobs": 3, "seed": 1}
        text = {"prompt": "Once upon a time", "logprobs": 3, "n": 2, "temperature": 0.9, "seed": 4}
        for body in ({"model": "tiny", "max_tokens": 5, **chat}, {"model": "tiny", "max_tokens": 5, **text}):
            create = client.chat.completions.create if "messages" in body else client.completions.create
            lines.append({"request": body, "response": create(**body).model_dump()})
            streamed = {**body, "stream_options": {"include_usage": True}}
            chunks = [c.model_dump() for c in create(**streamed, stream=True)]
            lines.append({"request": streamed, "response": chunks})
    finally:
        server.stop()
    return lines


@pytest.fixture(scope="module")
def seeds(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "hf.jsonl"
    prompts = [tiny.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in ("Hi.", "日本語 🎉")]
    hf_transcript(path, tiny, prompts, max_tokens=5)
    hf = [json.loads(line) for line in path.read_text().splitlines()]
    return {"hf": hf, "token_ids": _vllm_and_sglang(hf), "openai": _openai(tiny)}


@pytest.fixture(scope="module")
def reference(tiny):
    return reference_forward(tiny, "ours")


def _places(value, path=(), entries=6):
    """Every place in a parsed line (lists: their first `entries` entries), as paths of keys and indices."""
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _places(v, (*path, k), entries)
    elif isinstance(value, list):
        for i, v in enumerate(value[:entries]):
            yield from _places(v, (*path, i), entries)


def _mutations(line: dict):
    """The line with one place (a list's first 2 entries) replaced by each of the hostile values of distinct kinds,
    and with it deleted."""
    for path in list(_places(line, entries=2))[1:]:
        for value in (None, True, -1, 2**63, 1e308, float("nan"), float("-inf"), "x", "\ud800", [], {}, 49152, _DELETE):
            out = copy.deepcopy(line)
            holder = out
            for key in path[:-1]:
                holder = holder[key]
            if value is _DELETE:
                del holder[path[-1]]
            else:
                holder[path[-1]] = value
            yield out


_DELETE = object()


def _fit_for_the_audit(record, vocab: int) -> bool:
    """What audit_transcripts takes for granted of a record read."""
    ids = [*record.prompt_token_ids, *record.output_token_ids, *(t for alts in record.top for t, _ in alts)]
    values = [*(c for c in record.claimed if c is not None), *(lp for alts in record.top for _, lp in alts)]
    return (
        all(type(t) is int and 0 <= t < vocab for t in ids)
        and len(record.claimed) == len(record.output_token_ids) == len(record.top)
        and all(type(v) is float and v == v and v != float("inf") for v in values)
    )


def test_every_place_of_every_line_broken_every_way_is_read_by_name(seeds, reference, tiny, tmp_path, monkeypatch):
    """Each place of each seed line (a list's first 2 entries), replaced by each hostile value or deleted, one line
    each, in one file: every line is refused with a specific check's reason (not the catch-all's `unreadable:`)
    or read into a record the audit can take (ids inside the vocabulary, a claim per output token, no NaN or
    +inf); and an even sample of those records is audited. Before these checks, a top alternative's id past the
    vocabulary indexed out of bounds in the audit, an id of 2**63 overflowed, a `bytes` of 10**9 allocated a
    gigabyte, and a streamed chunk, a usage or a message that was not an object raised."""
    from toolkit.audit import transcripts

    vocab = tiny.arch.vocab_size
    monkeypatch.setattr(transcripts, "MAX_LINE_ERRORS", 10**6)  # every line's reason named, none only counted
    for fmt, lines in seeds.items():
        broken_lines = [m for line in lines for m in _mutations(line)]
        path = tmp_path / f"{fmt}.jsonl"
        path.write_text("".join(json.dumps(o) + "\n" for o in broken_lines))
        records, errors = read_transcripts(path, fmt, tiny.tokenizer, vocab)
        assert not [e for e in errors if "unreadable:" in e.why], fmt
        assert len({e.line for e in errors} | {r.line for r in records}) == len(broken_lines)
        unfit = [r.line for r in records if not _fit_for_the_audit(r, vocab)]
        assert not unfit, (fmt, broken_lines[unfit[0] - 1])
        sample = records[:: max(1, len(records) // 25)]
        report = audit_transcripts(sample, reference, tiny, atol=1e-4, reference="ours", line_errors=errors)
        assert report.to_dict()["lines_rejected"] == len(errors)
        # every record read fits the converted trace's columns (a finish_reason of 5, an id `true`: a pyarrow error)
        write_converted_trace(tmp_path / fmt, records, tiny, OmegaConf.create({}), source=str(path), fmt=fmt)


@st.composite
def broken(draw, seeds):
    fmt = draw(st.sampled_from(sorted(seeds)))
    line = copy.deepcopy(draw(st.sampled_from(seeds[fmt])))
    for _ in range(draw(st.integers(1, 2))):
        places = list(_places(line))[1:]
        path = draw(st.sampled_from(places))
        holder = line
        for key in path[:-1]:
            holder = holder[key]
        how = draw(st.sampled_from(["replace", "replace", "delete", "repeat"]))
        old = holder[path[-1]]
        if how == "delete":
            del holder[path[-1]]
        elif how == "repeat" and isinstance(old, (list, str)):
            holder[path[-1]] = old * draw(st.sampled_from([0, 3, 40]))
        else:
            holder[path[-1]] = copy.deepcopy(draw(st.sampled_from(HOSTILE)))
    return fmt, line


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
@example(data=None)  # the untouched seeds: audited clean
def test_a_broken_line_is_refused_by_name_or_audited_and_the_others_are_audited(seeds, reference, tiny, tmp_path, data):
    """A line broken anywhere is a LineError naming what is wrong (a specific check's reason, not the catch-all's
    `unreadable:`), or it is audited; its clean neighbour is audited either way; and the report is written. Before
    these checks: a top alternative's id past the vocabulary indexed out of bounds, an id of 2**63 overflowed, a
    `bytes` of 10**9 allocated a gigabyte, and a streamed chunk, a usage or a message that was not an object
    raised."""
    if data is None:
        for fmt, lines in seeds.items():
            (tmp_path / "t.jsonl").write_text("".join(json.dumps(o) + "\n" for o in lines))
            records, errors = read_transcripts(tmp_path / "t.jsonl", fmt, tiny.tokenizer, tiny.arch.vocab_size)
            report = audit_transcripts(records, reference, tiny, atol=1e-4, reference="ours", line_errors=errors)
            flagged = [(r["request_id"], r["flagged"][:2]) for r in report.to_dict()["requests"] if r["flagged"]]
            assert not errors and not flagged, (fmt, errors, flagged)
        return
    fmt, line = data.draw(broken(seeds))
    clean = seeds[fmt][-1]
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(line) + "\n" + json.dumps(clean) + "\n")
    records, errors = read_transcripts(path, fmt, tiny.tokenizer, tiny.arch.vocab_size)
    assert all("unreadable:" not in e.why and e.line == 1 for e in errors), errors
    assert any(r.line == 2 for r in records)  # the clean line is read
    report = audit_transcripts(records, reference, tiny, atol=1e-4, reference="ours", line_errors=errors)
    d = report.to_dict()
    json.dumps(d, allow_nan=True)
    assert d["lines_rejected"] == len(errors)
    write_converted_trace(tmp_path / "trace", records, tiny, OmegaConf.create({}), source=str(path), fmt=fmt)
