"""mode=audit: another engine's tokens and logprobs checked against the reference recomputation.

Real sources: HF `generate` on the same weights (tiny here; SmolLM2 in the slow tests), our own server
driven by the `openai` client, and llama.cpp (llama-cpp-python) on the Q4_1 GGUF when it is installed.
Tampering must be caught at the request and position it was made: a logprob shifted by 0.1, a token id
replaced, top logprobs holding more than probability 1.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from toolkit.audit.checks import audit_transcripts
from toolkit.audit.records import TokenMap
from toolkit.audit.sources import hf_transcript, llama_cpp_missing, llama_cpp_transcript, server_transcript
from toolkit.audit.transcripts import read_transcripts
from toolkit.errors import ConfigError, ForeignEngineError
from toolkit.reproduce.verify import reference_forward

ROOT = Path(__file__).resolve().parents[1]
CHATS = ("What is the capital of France?", "Write a haiku about rain.", "Name three colours.")


def _prompts(loaded, chats=CHATS):
    return [loaded.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in chats]


def _audit(path, fmt, loaded, atol=1e-4, reference="ours", mode=None):
    records, errors = read_transcripts(path, fmt, loaded.tokenizer, loaded.arch.vocab_size, mode)
    return audit_transcripts(
        records, reference_forward(loaded, reference), loaded, atol=atol, reference=reference, line_errors=errors
    )


@pytest.fixture(scope="module")
def hf_tiny(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("audit") / "hf.jsonl"
    hf_transcript(path, tiny, _prompts(tiny), max_tokens=12)
    return path


def _lines(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _write(path, objs):
    Path(path).write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


# ---------------------------------------------------------------------------------------- tampering


def test_untouched_hf_transcript_passes_at_fp32_tolerance(hf_tiny, tiny):
    report = _audit(hf_tiny, "hf", tiny)
    d = report.to_dict()
    assert report.passed, d["requests"]
    assert d["tokens"] == sum(len(o["output_token_ids"]) for o in _lines(hf_tiny)) > 0
    assert d["flagged_tokens"] == 0 and d["max_abs_error"] < 1e-4 and d["greedy_departures"] == 0
    assert d["ratio_outside_share"] == 0.0 and abs(d["ratio_mean"] - 1) < 1e-3
    assert d["kl_tokens"] == d["tokens"] and d["kl_max"] < 1e-6  # HF's top-5 agree with the reference


def _first_flag(report, request_id):
    rep = next(r for r in report.to_dict()["requests"] if r["request_id"] == request_id)
    return rep["flagged"][0] if rep["flagged"] else None


@pytest.mark.parametrize("tamper", ["shift", "replace", "mass"])
def test_tampering_is_flagged_at_its_request_and_position(hf_tiny, tiny, tmp_path, tamper):
    objs = _lines(hf_tiny)
    victim, j = objs[1], 3
    prompt_len = len(victim["prompt_token_ids"])
    if tamper == "shift":
        victim["logprobs"][j] += 0.1
    elif tamper == "replace":
        victim["output_token_ids"][j] = (victim["output_token_ids"][j] + 7) % tiny.arch.vocab_size
    else:  # top logprobs that hold more than probability 1
        victim["top_logprobs"][j] = [{"token_id": t, "logprob": -0.1} for t in range(5)]
    report = _audit(_write(tmp_path / "t.jsonl", objs), "hf", tiny)
    assert not report.passed
    flag = _first_flag(report, victim["request_id"])
    assert flag is not None and flag["position"] == prompt_len + j, flag
    expected = {"shift": "logprob", "replace": "logprob", "mass": "top_logprobs_mass"}[tamper]
    assert expected in flag["kind"].split(","), flag
    for other in (objs[0], objs[2]):  # the other requests are untouched and still pass
        assert _first_flag(report, other["request_id"]) is None
    if tamper == "shift":
        rep = next(r for r in report.requests if r.request_id == victim["request_id"])
        assert [c.position for c in rep.checks if c.kinds] == [prompt_len + j]  # only that token
        assert abs(rep.checks[j].ratio - 0.904837) < 1e-3  # exp(-0.1): the importance ratio sees it


def test_processed_claims_are_recomputed_through_the_stated_policy(tiny, tmp_path):
    """HF's scores (temperature -> top_k -> top_p) against our pipeline with the same parameters."""
    path = tmp_path / "sampled.jsonl"
    hf_transcript(path, tiny, _prompts(tiny), max_tokens=10, sampling={"temperature": 0.7, "top_k": 20, "top_p": 0.9})
    report = _audit(path, "hf", tiny, mode="processed_logprobs")
    assert report.passed, report.to_dict()["requests"]
    # a token outside the policy's support (rank > top_k) is flagged as one it could not have produced
    objs = _lines(path)
    import torch

    from toolkit.models.reference import reference_logits

    o = objs[0]
    logits = reference_logits(tiny.model, o["prompt_token_ids"])[-1]
    outsider = int(torch.argsort(logits, descending=True)[100])
    o["output_token_ids"] = [outsider] + o["output_token_ids"][1:]
    bad = _audit(_write(tmp_path / "outside.jsonl", objs), "hf", tiny)
    flag = _first_flag(bad, o["request_id"])
    assert flag["position"] == len(o["prompt_token_ids"]) and "outside_support" in flag["kind"]


def test_policy_fields_a_request_leaves_out_are_labelled_and_taken_from_the_stated_defaults(tiny, tmp_path):
    """A request that states temperature only: top_p / top_k / min_p are what a server's defaults make them. The
    audit says which it assumed and from where; given a server's top_k, a token outside it is flagged."""
    import torch

    from toolkit.audit.checks import assume_sampling, sampling_defaults
    from toolkit.models.reference import reference_logits

    prompt = tiny.tokenizer.apply_chat_template([{"role": "user", "content": "Pick a word."}])
    logits = reference_logits(tiny.model, prompt)[-1]
    rare = int(torch.argsort(logits, descending=True)[200])  # outside a top-20, inside "all tokens"
    line = {
        "request_id": "r0",
        "prompt_token_ids": prompt,
        "output_token_ids": [rare],
        "logprobs": [float(torch.log_softmax(logits.double(), -1)[rare])],
        "sampling": {"temperature": 1.0},
    }
    path = _write(tmp_path / "t.jsonl", [line])
    reports = {}
    for stated in ("library", {"top_k": 20}):
        label, defaults = sampling_defaults({"sampling_defaults": stated}, tiny)
        records, errors = read_transcripts(path, "token_ids", tiny.tokenizer, tiny.arch.vocab_size)
        assume_sampling(records, defaults)
        reports[label] = audit_transcripts(
            records, reference_forward(tiny, "ours"), tiny, atol=1e-4, reference="ours"
        ).to_dict()["requests"][0]
    library, server = reports["library defaults"], reports["audit.sampling_defaults"]
    assert library["sampling_assumed"] == {"top_p": 1.0, "top_k": -1, "min_p": 0.0} and library["flagged"] == []
    assert server["sampling_assumed"] == {"top_p": 1.0, "top_k": 20, "min_p": 0.0}
    assert [f["kind"] for f in server["flagged"]] == ["outside_support"]
    with pytest.raises(ConfigError, match="audit.sampling_defaults must be library, model or a mapping"):
        sampling_defaults({"sampling_defaults": {"seed": 3}}, tiny)


def test_greedy_departure_is_the_first_non_argmax_position(hf_tiny, tiny, tmp_path):
    import torch

    from toolkit.models.reference import reference_logits

    objs = _lines(hf_tiny)
    o, j = objs[0], 2
    ids = o["prompt_token_ids"] + o["output_token_ids"]
    logits = reference_logits(tiny.model, ids[: len(o["prompt_token_ids"]) + j])[-1]
    second = int(torch.topk(logits, 2).indices[1])
    o["output_token_ids"][j] = second
    o["logprobs"][j] = float(torch.log_softmax(logits.double(), -1)[second])  # an honest logprob of it
    report = _audit(_write(tmp_path / "g.jsonl", objs), "hf", tiny)
    rep = next(r for r in report.to_dict()["requests"] if r["request_id"] == o["request_id"])
    assert rep["first_greedy_departure"] == len(o["prompt_token_ids"]) + j
    assert "greedy_departure" in rep["flagged"][0]["kind"] and "logprob" not in rep["flagged"][0]["kind"]


def test_a_stated_logit_bias_is_applied_to_the_reference_and_its_ids_checked(tiny, tmp_path):
    """Before, the audit's policy left out logit_bias (OpenAI's field, keys as JSON strings): a greedy transcript
    whose bias banned the argmax was flagged greedy_departure at that token. An id past the vocabulary is its
    line's error naming logit_bias."""
    import torch

    from toolkit.models.reference import reference_logits

    prompt = tiny.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}])
    banned = int(reference_logits(tiny.model, prompt)[-1].argmax())
    output, logprobs = [], []
    for _ in range(4):  # greedy under the bias, with each token's raw logprob (what a server reports)
        logits = reference_logits(tiny.model, prompt + output)[-1].double()
        token = int((logits - 100.0 * (torch.arange(logits.numel()) == banned)).argmax())
        output.append(token)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
    assert output[0] != banned
    line = {"prompt_token_ids": prompt, "output_token_ids": output, "logprobs": logprobs}
    vocab = tiny.arch.vocab_size
    lines = [
        {**line, "request_id": "biased", "sampling": {"temperature": 0.0, "logit_bias": {str(banned): -100}}},
        {**line, "request_id": "unbiased", "sampling": {"temperature": 0.0}},
        {**line, "request_id": "past", "sampling": {"temperature": 0.0, "logit_bias": {str(vocab): -100}}},
        {**line, "request_id": "word", "sampling": {"temperature": 0.0, "logit_bias": {"red": -100}}},
    ]
    records, errors = read_transcripts(_write(tmp_path / "bias.jsonl", lines), "token_ids", tiny.tokenizer, vocab)
    report = audit_transcripts(records, reference_forward(tiny, "ours"), tiny, atol=1e-4, reference="ours")
    flagged = {r["request_id"]: [f["kind"] for f in r["flagged"]] for r in report.to_dict()["requests"]}
    assert flagged["biased"] == []
    assert flagged["unbiased"][0] == "greedy_departure"  # the same tokens without the bias: a departure
    why = {e.request_id: e.why for e in errors}
    assert why["past"].startswith(f"logit_bias key {vocab} is outside the model's vocabulary of {vocab}")
    assert why["word"].startswith("logit_bias keys must be token ids") and why["word"].endswith("got 'red'")


def test_a_grammar_constrained_request_checks_its_raw_logprobs_not_its_choices(tiny, tmp_path):
    """A request with response_format (or vLLM's guided_* / structured_outputs) had its grammar ignored: a JSON
    mode's forced "{" was flagged greedy_departure (and sampled ones outside_support). Another engine's grammar is
    not rebuilt here, so its greedy choices, support and alternatives go unchecked, said per request
    (`constrained`), while its tokens' raw logprobs are checked one-sided: vLLM takes them after the mask, so
    renormalised over the allowed tokens they are raised (never lowered). Processed logprobs under it cannot be
    checked, and say why; junk where a grammar goes is none."""
    import torch

    from toolkit.models.reference import reference_logits

    prompt = tiny.tokenizer.apply_chat_template([{"role": "user", "content": "Give JSON."}])
    logits = reference_logits(tiny.model, prompt)[-1].double()
    token = int(logits.argsort()[-5])  # what a grammar forced: not the argmax
    logprob = float(torch.log_softmax(logits, -1)[token])
    line = {"prompt_token_ids": prompt, "output_token_ids": [token], "logprobs": [logprob]}
    lines = [
        {**line, "request_id": "json", "sampling": {"temperature": 0.0, "response_format": {"type": "json_object"}}},
        {**line, "request_id": "regex", "sampling": {"temperature": 0.0, "guided_regex": "[0-9]+"}},
        {**line, "request_id": "text", "sampling": {"temperature": 0.0, "response_format": {"type": "text"}}},
        {**line, "request_id": "lie", "logprobs": [logprob - 0.5], "sampling": {"guided_regex": "a"}},
        {**line, "request_id": "vllm", "logprobs": [logprob + 0.5], "sampling": {"guided_regex": "a"}},
        {**line, "request_id": "junk", "sampling": {"temperature": 0.0, "response_format": {"type": ""}}},
        {**line, "request_id": "processed", "logprobs_mode": "processed_logprobs", "sampling": {"guided_regex": "a"}},
    ]
    records, errors = read_transcripts(
        _write(tmp_path / "g.jsonl", lines), "token_ids", tiny.tokenizer, tiny.arch.vocab_size
    )
    assert not errors, errors
    report = audit_transcripts(records, reference_forward(tiny, "ours"), tiny, atol=1e-4, reference="ours").to_dict()
    got = {r["request_id"]: ([f["kind"] for f in r["flagged"]], r["constrained"]) for r in report["requests"]}
    assert got["json"] == ([], "response_format json_object")
    assert got["regex"] == ([], "guided_regex")
    assert got["text"] == (["greedy_departure"], None)  # no grammar: the choice is checked
    assert got["lie"] == (["logprob"], "guided_regex")  # below the reference: no mask lowers a logprob
    assert got["vllm"] == ([], "guided_regex")  # above it: what renormalising over the allowed tokens gives
    assert got["junk"] == (["greedy_departure"], None)
    assert got["processed"] == (["constrained"], "guided_regex")


# ---------------------------------------------------------------------------------------- formats


def test_vllm_and_sglang_shapes_read_the_same_claims(hf_tiny, tiny, tmp_path):
    objs = _lines(hf_tiny)
    vllm, sglang = [], []
    for o in objs:  # vLLM: RequestOutput.logprobs as {id: Logprob}; SGLang: meta_info lists
        entries = []
        for t, lp, top in zip(o["output_token_ids"], o["logprobs"], o["top_logprobs"]):
            d = {str(a["token_id"]): {"logprob": a["logprob"], "rank": r + 1} for r, a in enumerate(top)}
            d[str(t)] = {"logprob": lp, "rank": None}
            entries.append(d)
        vllm.append(
            {
                "request_id": o["request_id"],
                "prompt_token_ids": o["prompt_token_ids"],
                "output_token_ids": o["output_token_ids"],
                "logprobs": entries,
                "origin_engine": "vllm",
            }
        )
        sglang.append(
            {
                "prompt_token_ids": o["prompt_token_ids"],
                "meta_info": {
                    "id": o["request_id"],
                    "output_token_logprobs": [[lp, t, None] for t, lp in zip(o["output_token_ids"], o["logprobs"])],
                    "output_top_logprobs": [
                        [[a["logprob"], a["token_id"], None] for a in top] for top in o["top_logprobs"]
                    ],
                },
            }
        )
    base = _audit(hf_tiny, "hf", tiny).to_dict()
    for objs2 in (vllm, sglang):
        d = _audit(_write(tmp_path / "x.jsonl", objs2), "token_ids", tiny).to_dict()
        assert d["passed"] and d["tokens"] == base["tokens"]
        assert d["max_abs_error"] == pytest.approx(base["max_abs_error"], rel=1e-6)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 49151), min_size=1, max_size=12))
def test_token_strings_map_back_to_their_ids_or_are_reported(token_map, ids):
    """A chat entry's bytes always name its token; a plain string does when the token's bytes are whole
    UTF-8 (else it is reported, never guessed); vLLM's token_id:<id> form always does."""
    tokens, tok = token_map
    for i in ids:
        b = tokens.bytes_of[i]
        text = b.decode("utf-8", errors="replace")
        assert tokens.to_id(text, list(b)) == (i, "")
        assert tokens.to_id(f"token_id:{i}") == (i, "")
        got, why = tokens.to_id(text)
        try:
            b.decode("utf-8")
            whole = True
        except UnicodeDecodeError:
            whole = False
        if whole and "\ufffd" not in text:
            assert got == i
        else:
            assert got is None and "partial UTF-8" in why


@pytest.fixture(scope="module")
def token_map(tiny):
    return TokenMap(tiny.tokenizer, tiny.arch.vocab_size), tiny.tokenizer


# ---------------------------------------------------------------------------------------- bad input, the CLI


def _run(tmp_path, *args):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), "mode=audit", "model=tiny", f"hydra.run.dir={out}", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    return proc, out


def test_cli_exit_codes_and_bad_lines_named(hf_tiny, tiny, tmp_path):
    proc, out = _run(tmp_path, f"audit.input={hf_tiny}", "audit.format=hf")
    assert proc.returncode == 0, proc.stderr
    d = json.loads((out / "audit.json").read_text())
    for key in ("tokens", "flagged_tokens", "max_abs_error", "p99_abs_error", "requests"):
        assert key in d
    assert set(d["requests"][0]) >= {"request_id", "tokens", "max_abs_error", "flagged"}
    assert (out / "audit.png").stat().st_size > 0 and (out / "requests.parquet").exists()

    objs = _lines(hf_tiny)
    objs[0]["logprobs"][1] = None  # a missing logprob
    objs[2]["output_token_ids"][0] = 10**6  # another tokenizer's id
    lines = [json.dumps(o) for o in objs]
    lines.insert(1, "{not json")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    proc, out2 = _run(tmp_path / "b", f"audit.input={bad}", "audit.format=hf")
    assert proc.returncode == 1, proc.stderr
    assert "line 2: not JSON" in proc.stderr and "line 4 (hf-2): " in proc.stderr and "vocabulary" in proc.stderr
    d = json.loads((out2 / "audit.json").read_text())
    assert {e["line"] for e in d["line_errors"]} == {2, 4}
    req0 = next(r for r in d["requests"] if r["request_id"] == "hf-0")
    assert req0["flagged"][0]["kind"] == "missing_logprob"
    assert req0["flagged"][0]["position"] == len(objs[0]["prompt_token_ids"]) + 1
    assert next(r for r in d["requests"] if r["request_id"] == "hf-1")["flagged"] == []  # still audited, clean

    proc, out3 = _run(tmp_path / "c", f"audit.input={tmp_path / 'absent.jsonl'}")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "not a file" in proc.stderr
    assert not (out3 / "audit.json").exists()
    junk = tmp_path / "junk.jsonl"
    junk.write_text("[1, 2]\n{}\n")
    proc, out4 = _run(tmp_path / "d", f"audit.input={junk}", "audit.format=openai")
    assert proc.returncode == 2 and "no usable request" in proc.stderr
    assert not (out4 / "audit.json").exists() and not (out4 / "samples.parquet").exists()


def test_lines_past_what_python_the_trace_or_the_model_holds_are_named_and_the_others_audited(tiny, tmp_path):
    """Each of these lines is its own error and the good one is audited, its converted trace written. Before: the
    deep line raised RecursionError and the long number ValueError out of the reader, a stream of 2**40 or 10**30
    failed the converted trace's int32 column after the audit ran, -5 was taken, and a prompt longer than the
    model's positions failed the reference's forward with a tensor size error."""
    positions = tiny.arch.max_position_embeddings
    good = {"request_id": "good", "prompt_token_ids": [1, 2, 3], "output_token_ids": [4, 5], "logprobs": [-1.0, -1.0]}
    lines = [
        json.dumps(good),
        "[" * 100000 + "]" * 100000,
        json.dumps({**good, "request_id": "digits"})[:-1] + ', "stream": ' + "7" * 5000 + "}",
        *(json.dumps({**good, "request_id": f"s{i}", "stream": s}) for i, s in enumerate([2**40, 10**30, -5])),
        json.dumps({**good, "request_id": "long", "prompt_token_ids": [504] * positions}),
    ]
    path = tmp_path / "limits.jsonl"
    path.write_text("\n".join(lines) + "\n")
    proc, out = _run(tmp_path, f"audit.input={path}", "audit.format=token_ids")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    named = [line for line in proc.stderr.splitlines() if line.startswith("line ")]
    assert named == [
        "line 2: not JSON: nested too deep to read",
        "line 3: not JSON: a number of more than 4300 digits",
        "line 4 (s0): stream must be an integer in [0, 2^31) (the sample's index), got 1099511627776",
        f"line 5 (s1): stream must be an integer in [0, 2^31) (the sample's index), got {10**30}",
        "line 6 (s2): stream must be an integer in [0, 2^31) (the sample's index), got -5",
        f"line 7 (long): prompt ({positions}) + output (2) = {positions + 2} tokens exceed the model's "
        f"{positions} positions",
    ], proc.stderr
    d = json.loads((out / "audit.json").read_text())
    assert [r["request_id"] for r in d["requests"]] == ["good"] and len(d["line_errors"]) == 6
    assert (out / "requests.parquet").exists()


def test_a_transcript_is_read_a_line_at_a_time_split_at_line_ends_only(tiny, tmp_path, monkeypatch):
    """A probe's findings: str.splitlines split a valid JSON line at a raw U+2028 or U+0085 in a string (JSON allows
    them unescaped; json.dumps(ensure_ascii=False) writes them), rejecting it and misnumbering every line after; a
    byte-order mark rejected the first line; the whole file was read at once and every rejected line kept (265 MB a
    million bad lines). Now: lines end at line ends only, a BOM is dropped, the file is streamed and the reasons
    past MAX_LINE_ERRORS are counted in one error, not kept."""
    from toolkit.audit import transcripts
    from toolkit.audit.records import TranscriptError, lines_rejected

    good = {"request_id": "a", "prompt_token_ids": [1, 2, 3], "output_token_ids": [4, 5], "logprobs": [-1.0, -1.0]}
    odd = json.dumps({**good, "request_id": "b", "note": "x\u2028y\x85z\u2029"}, ensure_ascii=False)
    path = tmp_path / "t.jsonl"
    path.write_text("\ufeff" + json.dumps(good) + "\r\n" + odd + "\n" + "not json\n" * 7 + json.dumps(good) + "\n")
    monkeypatch.setattr(transcripts, "MAX_LINE_ERRORS", 3)
    records, errors = read_transcripts(path, "token_ids", tiny.tokenizer, tiny.arch.vocab_size)
    assert [r.request_id for r in records] == ["a", "b", "a~1"] and records[1].source == odd
    assert [e.line for e in errors] == [3, 4, 5, 6] and lines_rejected(errors) == 7
    assert errors[-1].why.startswith("and 4 more lines rejected from here on") and errors[-1].more == 3
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    with pytest.raises(TranscriptError, match="a gzip file: decompress it first"):
        read_transcripts(gz, "token_ids", tiny.tokenizer, tiny.arch.vocab_size)
    # a line not UTF-8, and one past MAX_LINE_BYTES, are each a named line: the others are still read (one bad byte
    # aborted the whole file; a 200 MB line was audited at 2.5 GB)
    monkeypatch.setattr(transcripts, "MAX_LINE_BYTES", 1000)
    long = json.dumps({**good, "request_id": "long", "pad": "x" * 5000})
    path.write_bytes(
        b"\n".join([json.dumps(good).encode(), b'{"caf\xe9": 1}', long.encode(), json.dumps(good).encode()])
    )
    records, errors = read_transcripts(path, "token_ids", tiny.tokenizer, tiny.arch.vocab_size)
    assert [r.request_id for r in records] == ["a", "a~1"]
    assert [(e.line, e.why) for e in errors] == [
        (2, "not UTF-8: byte 5 is b'\\xe9'"),
        (3, "longer than 1,000 bytes: not read"),
    ]


@pytest.mark.parametrize("index", [-1, "0", 1.0, True])
def test_a_choice_index_that_is_no_count_is_named(tiny, tmp_path, index):
    """A choice's index of -1 took the last prompt and stream n - 1; one that was no integer, stream 0."""
    choice = {"index": index, "text": "a", "logprobs": {"tokens": ["a"], "token_logprobs": [-1.0]}}
    line = {"request": {"prompt": ["hi", "yo"], "n": 2, "logprobs": 0}, "response": {"choices": [choice]}}
    records, errors = read_transcripts(_write(tmp_path / "o.jsonl", [line]), "openai", tiny.tokenizer, 49152)
    assert not records and len(errors) == 1 and "index must be an integer >= 0" in errors[0].why, errors


def test_chat_template_mismatch_is_named(tiny, tmp_path):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    response = {
        "id": "c1",
        "choices": [
            {
                "index": 0,
                "message": {"content": "Hello"},
                "finish_reason": "stop",
                "logprobs": {"content": [{"token": "Hello", "logprob": -0.5}]},
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
    }
    path = _write(tmp_path / "chat.jsonl", [{"request": body, "response": response}])
    records, errors = read_transcripts(path, "openai", tiny.tokenizer, tiny.arch.vocab_size)
    assert not records and len(errors) == 1 and "chat template" in errors[0].why and errors[0].line == 1


def test_a_completion_whose_logprobs_come_in_the_chat_shape_reads_as_the_classic_one(tiny, tmp_path):
    """llama-server answers /v1/completions with `logprobs.content` ({token, logprob, bytes, top_logprobs} entries,
    the chat shape), not `tokens` / `token_logprobs`: every line was refused. Both shapes read the same claims."""
    prompt = "Once upon a time"
    ids = tiny.tokenizer.encode(" there was a fox", add_special_tokens=False)
    raw = tiny.tokenizer.token_bytes(tiny.arch.vocab_size)
    strings = [raw[i].decode("utf-8", errors="replace") for i in ids]
    claims = [-0.5 - 0.25 * j for j in range(len(ids))]
    tops = [{s: c, "zz": c - 1.0} for s, c in zip(strings, claims)]
    classic = {"tokens": strings, "token_logprobs": claims, "top_logprobs": tops}
    content = {
        "content": [
            {
                "token": s,
                "logprob": c,
                "bytes": list(raw[i]),
                "top_logprobs": [{"token": t, "logprob": v} for t, v in top.items()],
            }
            for s, c, i, top in zip(strings, claims, ids, tops)
        ]
    }
    usage = {"prompt_tokens": len(tiny.tokenizer.encode(prompt)), "completion_tokens": len(ids)}
    lines = [
        {
            "request": {"model": "m", "prompt": prompt, "logprobs": 2},
            "response": {
                "id": f"cmpl-{k}",
                "choices": [
                    {"index": 0, "text": tiny.tokenizer.decode(ids), "finish_reason": "length", "logprobs": lp}
                ],
                "usage": usage,
            },
        }
        for k, lp in (("classic", classic), ("content", content))
    ]
    records, errors = read_transcripts(
        _write(tmp_path / "c.jsonl", lines), "openai", tiny.tokenizer, tiny.arch.vocab_size
    )
    assert not errors, errors
    a, b = records
    assert a.output_token_ids == b.output_token_ids == ids and not a.problems and not b.problems
    assert a.claimed == b.claimed == claims and a.top == b.top


def test_a_logprob_given_as_a_string_is_named_as_a_string(tiny, tmp_path):
    """A logprob of "-inf" (the string) was "logprobs[0] is -inf, not a log-probability (a number, or -inf)"."""
    line = {"prompt_token_ids": [1, 2], "output_token_ids": [3, 4], "logprobs": ["-inf", "-0.5"]}
    _, errors = read_transcripts(_write(tmp_path / "s.jsonl", [line]), "token_ids", tiny.tokenizer, 49152)
    assert len(errors) == 1 and "is '-inf', not a log-probability (a JSON number, or -inf)" in errors[0].why


def test_converted_trace_verifies_with_mode_verify(hf_tiny, tmp_path):
    proc, out = _run(tmp_path, f"audit.input={hf_tiny}", "audit.format=hf")
    assert proc.returncode == 0, proc.stderr
    from toolkit.trace.reader import read_requests, read_samples

    requests = read_requests(out).to_pylist()
    assert {r["origin_engine"] for r in requests} == {"hf generate"}
    assert all(json.loads(r["source_record"])["request_id"] == r["request_id"] for r in requests)
    assert read_samples(out).num_rows == sum(len(r["output_token_ids"]) for r in requests)
    verify = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), "mode=verify", f"verify.trace={out}", f"hydra.run.dir={tmp_path / 'v'}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert verify.returncode == 0 and "verified" in verify.stdout, verify.stdout + verify.stderr


def test_a_converted_trace_without_the_models_logprobs_verifies_its_tokens_alone(tmp_path):
    """An audited transcript's trace holds no raw logprob where the claim was null, nor in a processed-logprobs
    transcript: verify died there with a TypeError traceback (a probe's finding). It now checks those rows' tokens
    and says how many recorded no logprob; a claim it has is still compared."""
    from toolkit import verify

    lines = [
        {"request_id": "a", "prompt_token_ids": [1, 2, 3], "output_token_ids": [5, 6], "logprobs": [-10.0, None]},
        {"request_id": "p", "prompt_token_ids": [1, 2, 3], "output_token_ids": [5, 6], "logprobs": [-1.0, -1.0]},
    ]
    lines[1] |= {"logprobs_mode": "processed_logprobs", "sampling": {"temperature": 1.0, "top_k": 2}}
    proc, out = _run(tmp_path, f"audit.input={_write(tmp_path / 't.jsonl', lines)}", "audit.format=token_ids")
    assert (out / "samples.parquet").exists(), proc.stderr
    report = verify(out)
    assert report.unclaimed_rows == 3 and report.rows_checked == 4
    assert [(f.request_id, f.position) for f in report.failures] == [("a", 3)]  # the one claim, and it is wrong
    assert "3 rows record no raw logprob" in report.summary_line()


# ---------------------------------------------------------------------------------------- real engines, SmolLM2


@pytest.mark.native
@pytest.mark.slow
def test_our_server_verifies_within_fp32_tolerance(smollm2, tmp_path):
    from toolkit.config import EngineConfig
    from toolkit.engine.core import Engine
    from toolkit.sampling.params import SamplingParams

    engine = Engine(smollm2, EngineConfig(), SamplingParams())
    path = tmp_path / "server.jsonl"
    server_transcript(
        path, engine, CHATS + ("Count to five.",), max_tokens=16, sampling={"temperature": 0.8, "top_p": 0.9, "seed": 3}
    )
    report = _audit(path, "openai", smollm2)
    d = report.to_dict()
    assert report.passed and d["lines_rejected"] == 0, d
    assert d["tokens"] >= 4 and d["max_abs_error"] < 1e-4 and d["kl_max"] < 1e-6
    assert {r["origin_engine"] for r in d["requests"]} == {"toolkit server"}


@pytest.mark.slow
def test_hf_generate_on_smollm2_passes_both_references(smollm2, tmp_path):
    path = tmp_path / "hf.jsonl"
    hf_transcript(path, smollm2, _prompts(smollm2, CHATS[:2]), max_tokens=12)
    for reference in ("ours", "hf"):
        d = _audit(path, "hf", smollm2, reference=reference).to_dict()
        assert d["passed"] and d["max_abs_error"] < 1e-4, (reference, d)


@pytest.mark.slow
def test_llama_cpp_error_is_bounded_and_its_departures_are_near_ties(smollm2, tmp_path):
    missing = llama_cpp_missing()
    if missing:
        print(f"SKIP reason: {missing}")
        pytest.skip(missing)
    from toolkit.models.loading import smollm2_gguf

    path = tmp_path / "llama.jsonl"
    try:
        llama_cpp_transcript(path, smollm2_gguf(), _prompts(smollm2, CHATS), max_tokens=16)
    except ForeignEngineError as exc:  # its native code died of a signal here: a reason, not the suite's death
        if "killed by signal" not in str(exc):
            raise
        print(f"SKIP reason: {exc}")
        pytest.skip(str(exc))
    d = _audit(path, "openai", smollm2).to_dict()
    assert d["lines_rejected"] == 0 and d["tokens"] >= 3 * 8
    # Q4_1 weights are the same numbers as our fp32 ones; llama.cpp quantises activations to 8 bits
    assert 1e-3 < d["max_abs_error"] < 1.0, d["max_abs_error"]
    assert 0.5 < d["ratio_mean"] < 2
    for r in d["requests"]:  # any greedy departure is a near tie within llama.cpp's own measured error
        if r["first_greedy_departure"] is not None:
            assert r["first_departure_margin"] <= 2 * r["max_abs_error"], r


@pytest.mark.native
def test_streamed_responses_audit_like_whole_ones(tiny, tmp_path):
    """Our server streamed through the openai client: the chunks, kept as a list, read as one response."""
    import openai

    from tests.conftest import make_engine
    from toolkit.sampling.params import SamplingParams
    from toolkit.serve.main import start_server

    server = start_server(make_engine(tiny, sampling=SamplingParams()), None)
    lines = []
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        for body in (
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "Say hi."}],
                "max_tokens": 6,
                "logprobs": True,
                "top_logprobs": 3,
                "temperature": 0.0,
            },
            {
                "model": "tiny",
                "prompt": "Once upon a time",
                "max_tokens": 6,
                "logprobs": 3,
                "n": 2,
                "temperature": 0.9,
                "seed": 4,
            },
        ):
            create = client.chat.completions.create if "messages" in body else client.completions.create
            whole = create(**body).model_dump()
            streamed = {**body, "stream_options": {"include_usage": True}}  # the count that confirms the prompt
            chunks = [c.model_dump() for c in create(**streamed, stream=True)]
            lines += [{"request": body, "response": whole}, {"request": streamed, "response": chunks}]
    finally:
        server.stop()
    report = _audit(_write(tmp_path / "s.jsonl", lines), "openai", tiny)
    d = report.to_dict()
    assert d["passed"] and d["lines_rejected"] == 0, [r["flagged"] for r in d["requests"]]
    assert [r["prompt"] for r in d["requests"]] == ["rebuilt"] * 2 + ["encoded"] * 4
    # without the usage chunk nothing confirms the rebuilt prompts: reported, not audited as if exact
    bare = [
        {"request": line["request"], "response": [c for c in line["response"] if not c.get("usage")]}
        for line in lines[1::2]
    ]
    d = _audit(_write(tmp_path / "bare.jsonl", bare), "openai", tiny).to_dict()
    assert d["tokens"] == 0 and not d["passed"]
    assert {f["kind"] for r in d["requests"] for f in r["flagged"]} == {"unconfirmed_prompt"}
    by_line = {}
    for r in report.requests:
        by_line.setdefault(r.line, []).append([c.token_id for c in r.checks])
    assert by_line[1] == by_line[2] and by_line[3] == by_line[4]  # the same tokens whole and streamed
    assert len(by_line[3]) == 2 and all(len(t) == 6 for t in by_line[3])  # n=2 streams, 6 tokens each
