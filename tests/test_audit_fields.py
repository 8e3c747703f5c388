"""mode=audit: a line's field of the wrong kind is that line's error, naming the field, and the other lines are
audited. A probe's findings: a finish_reason that was no string and a JSON `true` among token ids were read and
then failed the converted trace's columns (a pyarrow traceback, exit 1, no audit.json); a stated sampling field
SamplingParams refuses (`"top_k": "50"`) turned the greedy and support checks off (a false PASS); a lone `\\r`
split a line in two."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from toolkit.audit.checks import assume_sampling, audit_transcripts
from toolkit.audit.foreign import write_converted_trace
from toolkit.audit.records import Transcript, TranscriptError, check_ids
from toolkit.audit.transcripts import _lines, read_transcripts
from toolkit.reproduce.verify import reference_forward

ROOT = Path(__file__).resolve().parents[1]
GOOD = {"request_id": "good", "prompt_token_ids": [1, 2, 3], "output_token_ids": [4, 5], "logprobs": [-1.0, -1.0]}


def _write(path, objs):
    Path(path).write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


def _greedy_line(tiny):
    """A line whose second token is the reference's least likely (its first the argmax), every claim the
    reference's own logprob."""
    import torch

    from toolkit.models.reference import reference_logits

    prompt = [1, 2, 3]
    output = [int(reference_logits(tiny.model, prompt)[-1].argmax())]
    output.append(int(reference_logits(tiny.model, prompt + output)[-1].argmin()))
    rows = torch.log_softmax(reference_logits(tiny.model, prompt + output)[len(prompt) - 1 : -1].double(), -1)
    logprobs = [float(rows[j, t]) for j, t in enumerate(output)]
    return {"prompt_token_ids": prompt, "output_token_ids": output, "logprobs": logprobs}


def test_fields_the_trace_stores_are_checked_and_a_bad_one_refuses_its_line_alone(tiny, tmp_path):
    """finish_reason (token_ids, SGLang's meta_info, an openai choice, whole or streamed), origin_engine and token
    ids given as `true` (an openai response's or request's prompt): each its line's error naming the field; the
    good lines are read and their converted trace written."""
    vocab = tiny.arch.vocab_size
    sglang = {"prompt_token_ids": [1, 2, 3], "meta_info": {"id": "sg", "output_token_logprobs": [[-1.0, 4, None]]}}
    token_ids = [
        GOOD,
        {**GOOD, "request_id": "fr", "finish_reason": 5},
        {**GOOD, "request_id": "eng", "origin_engine": {"name": "x"}},
        {**sglang, "meta_info": {**sglang["meta_info"], "finish_reason": {"type": ["stop"]}}},
        {**sglang, "request_id": "sg2", "meta_info": {**sglang["meta_info"], "id": "sg2", "finish_reason": 1.5}},
        {**GOOD, "request_id": "ok", "finish_reason": "length", "origin_engine": "vllm"},
    ]
    records, errors = read_transcripts(_write(tmp_path / "t.jsonl", token_ids), "token_ids", tiny.tokenizer, vocab)
    assert [(e.line, e.why) for e in errors] == [
        (2, "finish_reason must be a string or null, got 5"),
        (3, "origin_engine must be a string or null, got {'name': 'x'}"),
        (4, "meta_info.finish_reason.type must be a string or null, got ['stop']"),
        (5, "meta_info.finish_reason must be a string or null, got 1.5"),
    ]
    assert [r.request_id for r in records] == ["good", "ok"] and records[1].finish_reason == "length"

    choice = {"text": "", "token_ids": [5, 6], "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0]}}
    ids = {"request": {"prompt": [1, 2, 3]}, "response": {"choices": [choice]}}
    chunk = {"choices": [{**choice, "finish_reason": 7}]}
    openai = [
        ids,
        {**ids, "response": {"choices": [{**choice, "finish_reason": ["stop"]}]}},
        {"request": {"prompt": "hi"}, "response": {"prompt_token_ids": [True, 1, 2], "choices": [choice]}},
        {"request": {"prompt": [True, 1, 2]}, "response": {"choices": [choice]}},
        {"request": {"prompt": [[1, 2], [False]]}, "response": {"choices": [choice]}},
        {**ids, "origin_engine": 3},
        {**ids, "response": [chunk]},
    ]
    records, errors = read_transcripts(_write(tmp_path / "o.jsonl", openai), "openai", tiny.tokenizer, vocab)
    assert [(e.line, e.why) for e in errors] == [
        (2, "choices[0].finish_reason must be a string or null, got ['stop']"),
        (3, "response.prompt_token_ids must be a list of token ids"),
        (4, "request.prompt must be text, token ids or a list of them"),
        (5, "request.prompt must be text, token ids or a list of them"),
        (6, "origin_engine must be a string or null, got 3"),
        (7, "choices[0].finish_reason must be a string or null, got 7"),
    ]
    assert [r.line for r in records] == [1]
    write_converted_trace(tmp_path / "run", records, tiny, OmegaConf.create({}), source="o.jsonl", fmt="openai")
    assert (tmp_path / "run" / "requests.parquet").exists()


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 99), min_size=1, max_size=5),
    output=st.lists(st.integers(0, 99), min_size=1, max_size=5),
    where=st.sampled_from(["prompt", "output", "top"]),
    at=st.integers(0, 5),
    flag=st.booleans(),
)
def test_a_json_boolean_is_no_token_id_wherever_ids_are_read(prompt, output, where, at, flag):
    """Python's True is the int 1: check_ids took `true` for token 1 (the trace's int64 column then refused it)."""
    top = [[(t, -1.0)] for t in output]
    record = Transcript("r", 0, 1, "x", list(prompt), list(output), [-1.0] * len(output), top)
    check_ids(record, 100)  # integer ids inside the vocabulary pass
    if where == "top":
        record.top[at % len(output)] = [(flag, -1.0)]
    else:
        ids = record.prompt_token_ids if where == "prompt" else record.output_token_ids
        ids.insert(at % (len(ids) + 1), flag)
    with pytest.raises(TranscriptError, match=f"token(_ids)? {flag} is not a token id"):
        check_ids(record, 100)


def test_a_stated_sampling_field_that_reads_as_no_policy_refuses_its_line(tiny, tmp_path):
    """A greedy line taking a non-argmax token is flagged; with a sampling field SamplingParams refuses it passed,
    its policy read as none; now that line is refused naming the field. No sampling stated: no policy is checked,
    as documented; a null field is one left out (the default assumed). A stated policy the defaults complete into
    none (a default top_k its `processors` leave out) is refused too."""
    line = _greedy_line(tiny)
    lines = [
        {**line, "request_id": "greedy", "sampling": {"temperature": 0}},
        {**line, "request_id": "bad_top_k", "sampling": {"temperature": 0, "top_k": "50"}},
        {**line, "request_id": "bad_temperature", "sampling": {"temperature": "0"}},
        {**line, "request_id": "none_stated"},
        {**line, "request_id": "null_top_k", "sampling": {"temperature": 0, "top_k": None}},
        {**line, "request_id": "processors", "sampling": {"temperature": 0, "processors": ["temperature"]}},
    ]
    path = _write(tmp_path / "g.jsonl", lines)
    records, errors = read_transcripts(path, "token_ids", tiny.tokenizer, tiny.arch.vocab_size)
    assert [(e.request_id, e.why) for e in errors] == [
        ("bad_top_k", "the stated sampling: top_k must be -1 (all tokens), 0 (all tokens) or a positive integer "
         "up to 2147483647, got '50'"),
        ("bad_temperature", "the stated sampling: temperature must be 0 (greedy) or a number in [1e-05, 1e+05], "
         "got '0'"),
    ]  # fmt: skip
    rejected = assume_sampling(records, {"top_k": 20})
    assert [(e.line, e.request_id) for e in rejected] == [(6, "processors")]
    assert rejected[0].why.startswith("the stated sampling with the defaults assumed (top_k=20): top_k is set")
    report = audit_transcripts(records, reference_forward(tiny, "ours"), tiny, atol=1e-4, reference="ours")
    kinds = {r["request_id"]: [(f["position"], f["kind"]) for f in r["flagged"]] for r in report.to_dict()["requests"]}
    departure = [(4, "outside_support,greedy_departure")]  # the default top_k 20 assumed: outside it too
    assert kinds == {"greedy": departure, "none_stated": [], "null_top_k": departure}


def test_the_cli_names_each_bad_line_audits_the_others_and_writes_its_report(tiny, tmp_path):
    """The probe's inputs in one file: a finish_reason of 5 (was a pyarrow traceback, exit 1, no audit.json), a
    greedy departure under `"top_k": "50"` (was PASSED), a line with a bare `\\r` (was split in two)."""
    line = _greedy_line(tiny)
    text = "".join(
        json.dumps(o) + "\n"
        for o in (
            {**line, "request_id": "clean"},
            {**line, "request_id": "fr", "finish_reason": 5},
            {**line, "request_id": "top_k", "sampling": {"temperature": 0, "top_k": "50"}},
        )
    )
    text += json.dumps({**line, "request_id": "cr"}).replace(", ", ",\r", 1) + "\r\n"
    path = tmp_path / "probe.jsonl"
    path.write_text(text, newline="")
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), "mode=audit", "model=tiny", f"hydra.run.dir={out}"]
        + [f"audit.input={path}", "audit.format=token_ids"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    named = [x for x in proc.stderr.splitlines() if x.startswith("line ")]
    assert named == [
        "line 2 (fr): finish_reason must be a string or null, got 5",
        "line 3 (top_k): the stated sampling: top_k must be -1 (all tokens), 0 (all tokens) or a positive "
        "integer up to 2147483647, got '50'",
    ]
    d = json.loads((out / "audit.json").read_text())
    assert [(r["request_id"], r["line"], r["flagged"]) for r in d["requests"]] == [("clean", 1, []), ("cr", 4, [])]
    assert d["lines_rejected"] == 2 and (out / "requests.parquet").exists()


@settings(max_examples=60, deadline=None)
@given(
    lines=st.lists(
        st.text(st.sampled_from("\r\x85\u2028\u2029\x0b\x0c\x1c\x1d\x1e{ aé🙂"), max_size=8).filter(
            lambda s: not s.endswith("\r")
        ),
        min_size=1,
        max_size=6,
    ),
    ends=st.lists(st.sampled_from(["\n", "\r\n"]), min_size=6, max_size=6),
    bom=st.booleans(),
)
@example(lines=['{"a":\r1}', "x\x85\u2028y", ""], ends=["\r\n", "\n", "\n"] * 2, bom=True)
def test_lines_end_at_a_newline_only(lines, ends, bom):
    """docs/audit.md: lines end at \\n or \\r\\n only (a lone \\r, U+2028 or U+0085 inside stays in its line), a
    UTF-8 byte-order mark is dropped; the last line may have no end."""
    text = ("\ufeff" if bom else "") + "".join(line + end for line, end in zip(lines, ends))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "t.jsonl"
        path.write_bytes(text.encode())
        assert list(_lines(path)) == lines
        path.write_bytes(text[: len(text) - len(ends[len(lines) - 1])].encode())  # the last line without its end
        assert list(_lines(path)) == (lines if lines[-1] else lines[:-1])
