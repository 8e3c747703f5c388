"""Structured outputs through xgrammar: every output parses and validates, no token ever leaves the grammar."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import make_engine
from toolkit.errors import ConfigError, RequestError
from toolkit.sampling.params import SamplingParams
from toolkit.sampling.structured import StructuredOutputs
from toolkit.sampling.unenforced import ignored_in_regex, unenforced_keyword

SCHEMAS = {
    "person": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 30},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "email": {"type": "string", "maxLength": 40},
            },
            "required": ["name", "age", "email"],
        },
        "Write a JSON record for Ada Lovelace, aged 36, email ada@example.com.",
    ),
    "nested": (
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer"},
                        "profile": {
                            "type": "object",
                            "properties": {
                                "city": {"type": "string", "maxLength": 20},
                                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                            },
                            "required": ["city", "zip"],
                        },
                    },
                    "required": ["id", "profile"],
                },
                "active": {"type": "boolean"},
            },
            "required": ["user", "active"],
        },
        "Describe user 7 who lives in Paris (zip 75001) and is active, as JSON.",
    ),
    "array": (
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "maxItems": 4,
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string", "maxLength": 10},
                            "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                        },
                        "required": ["sku", "qty"],
                    },
                },
                "total": {"type": "number"},
            },
            "required": ["items", "total"],
        },
        "An order of 2 apples (sku A1) and 3 pears (sku P2) costing 4.5 in total, as JSON.",
    ),
    "enum": (
        {
            "type": "object",
            "properties": {
                "status": {"enum": ["pending", "shipped", "delivered"]},
                "priority": {"enum": [1, 2, 3]},
                "note": {"type": "string", "maxLength": 30},
            },
            "required": ["status", "priority", "note"],
        },
        "The parcel was shipped with high priority. Give its status as JSON.",
    ),
    "numbers": (
        {
            "type": "object",
            "properties": {
                "temperature": {"type": "number", "minimum": -50, "maximum": 60},
                "readings": {"type": "array", "maxItems": 5, "items": {"type": "number"}},
                "unit": {"const": "C"},
            },
            "required": ["temperature", "readings", "unit"],
        },
        "Today it is 21.5 degrees Celsius; earlier readings were 19, 20 and 21. Answer in JSON.",
    ),
}


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.mark.native
@pytest.mark.slow
def test_smollm2_json_outputs_parse_and_validate(smollm2):
    engine = make_engine(smollm2, max_num_batched_tokens=256, max_num_seqs=16)
    requests = []
    for name, (schema, prompt) in SCHEMAS.items():
        for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2)):
            requests.append(
                {
                    "messages": chat(prompt),
                    "request_id": f"{name}-{temperature}-{seed}",
                    "sampling_params": SamplingParams(
                        temperature=temperature, seed=seed, max_tokens=256, structured_outputs={"json": schema}
                    ),
                }
            )
    outputs = engine.generate(requests)
    finished = 0
    for r, out in zip(requests, outputs):
        spec = r["sampling_params"].structured_outputs
        if out.finish_reason == "length":  # which sampled path runs long (an unbounded number or string) is the
            # CPU's rounding; the grammar still holds it to a prefix of a valid document
            engine.grammar.matcher(spec, out.output_token_ids)  # raises at a token the grammar did not allow
            continue
        assert out.finish_reason == "stop", (r["request_id"], out.text)
        jsonschema.validate(json.loads(out.text), spec.json)
        finished += 1
    assert finished >= len(requests) // 2, f"{finished} of {len(requests)} finished within 256 tokens"
    assert engine.grammar.compilations == len(SCHEMAS)  # compiled once per distinct schema


@pytest.mark.native
def test_empty_schema_means_any_json_object(tiny):
    engine = make_engine(tiny)
    spec = SamplingParams(structured_outputs={"json": {}}).structured_outputs
    accepts = lambda text: engine.grammar.matcher(spec).accept_string(text)  # noqa: E731
    assert accepts('{"a": [1, {"b": null}], "c": "d"}')
    assert not accepts("[1, 2]") and not accepts('"text"')


@pytest.mark.native
@pytest.mark.slow
def test_smollm2_regex_and_choice_outputs(smollm2):
    engine = make_engine(smollm2, max_num_batched_tokens=256, max_num_seqs=16)
    date, email = r"\d{4}-\d{2}-\d{2}", r"[a-z]{1,12}@[a-z]{1,12}\.(com|org)"
    choices = ["positive", "negative", "neutral"]
    requests = []
    for seed in range(3):
        params = dict(temperature=1.0, seed=seed, max_tokens=40)
        requests += [
            {
                "messages": chat("When did the first moon landing happen?"),
                "sampling_params": SamplingParams(**params, structured_outputs={"regex": date}),
            },
            {
                "messages": chat("Make up an email address for a baker."),
                "sampling_params": SamplingParams(**params, structured_outputs={"regex": email}),
            },
            {
                "messages": chat("Sentiment of: I love this bread!"),
                "sampling_params": SamplingParams(**params, structured_outputs={"choice": choices}),
            },
        ]
    outs = engine.generate(requests)
    for i, out in enumerate(outs):
        kind = i % 3
        if kind == 0:
            assert re.fullmatch(date, out.text), out.text
        elif kind == 1:
            assert re.fullmatch(email, out.text), out.text
        else:
            assert out.text in choices
        assert out.finish_reason == "stop"


@st.composite
def grammar_mixes(draw):
    specs = [
        None,
        {"regex": r"[a-c]{2,6}"},
        {"choice": ["alpha", "beta", "gamma delta"]},
        {"json": {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}},
        {"grammar": 'root ::= "(" [0-9]+ ")" | "none"'},
    ]
    requests = []
    for i in range(draw(st.integers(1, 6))):
        spec = draw(st.sampled_from(specs))
        requests.append(
            {
                "prompt_token_ids": draw(st.lists(st.integers(0, 49151), min_size=1, max_size=12)),
                "request_id": f"g{i}",
                "arrival_step": draw(st.integers(0, 4)),
                "sampling_params": SamplingParams(
                    temperature=draw(st.sampled_from([0.0, 1.0])),
                    seed=i,
                    max_tokens=24,
                    structured_outputs=spec,
                    top_k=draw(st.sampled_from([-1, 5])),
                ),
            }
        )
    return requests, draw(st.integers(2, 24))


@pytest.mark.native
@settings(max_examples=15, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mix=grammar_mixes())
def test_no_sampled_token_ever_leaves_the_grammar(tiny, mix):
    requests, budget = mix
    engine = make_engine(tiny, max_num_batched_tokens=budget, max_num_seqs=min(budget, 6))
    outputs = engine.generate(requests)
    for r, out in zip(requests, outputs):
        spec = r["sampling_params"].structured_outputs
        if spec is None:
            continue
        matcher = engine.grammar.matcher(spec)
        assert all(matcher.accept_token(t) for t in out.output_token_ids), out.output_token_ids
        assert out.finish_reason in ("stop", "length")
        if out.finish_reason == "stop":
            assert matcher.is_completed()
            if spec.kind == "choice":
                assert out.text in spec.choice
            if spec.kind == "regex":
                assert re.fullmatch(spec.regex, out.text)


@pytest.mark.native
def test_grammar_rows_survive_preemption(tiny):
    """Recompute preemption rebuilds the matcher from the committed tokens; outputs do not change."""
    rnd = random.Random(3)
    spec = {"regex": r"(ab|cd|ef){1,20}"}
    requests = [
        {
            "prompt_token_ids": [rnd.randrange(49152) for _ in range(rnd.randint(10, 30))],
            "request_id": f"r{i}",
            "sampling_params": SamplingParams(
                temperature=1.0, seed=i, max_tokens=30, ignore_eos=True, structured_outputs=spec
            ),
        }
        for i in range(8)
    ]
    ample = make_engine(tiny, num_kv_blocks=256, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    tight = make_engine(tiny, num_kv_blocks=30, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a = [o.output_token_ids for o in ample.generate(requests)]
    t = [o.output_token_ids for o in tight.generate(requests)]
    assert sum(s.num_preemptions for s in tight.requests.values()) >= 3
    assert a == t


@pytest.mark.native
@pytest.mark.parametrize(
    "spec, message",
    [
        ({"json": {"type": "objectx"}}, 'invalid structured_outputs.json: Unsupported type "objectx"'),
        ({"regex": "([a-z"}, "invalid structured_outputs.regex: Regex parsing error"),
        ({"grammar": 'root ::= "a" | b'}, "invalid structured_outputs.grammar: EBNF parser error at line 1, column 16"),
    ],
)
def test_invalid_grammars_are_refused_with_the_compiler_message(tiny, spec, message):
    engine = make_engine(tiny)
    with pytest.raises(RequestError) as info:
        engine.add_request(prompt_token_ids=[1, 2], sampling_params=SamplingParams(structured_outputs=spec))
    assert message in str(info.value) and "\n" not in str(info.value)
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"json": {}, "regex": "a"}, "exactly one of"),
        ({"choice": []}, "non-empty list"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"xml": "<a/>"}, "unknown structured_outputs field"),
    ],
)
def test_malformed_structured_outputs_spec(spec, match):
    from toolkit.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        SamplingParams(structured_outputs=spec)


@pytest.mark.native
def test_grammar_trace_and_replay(tiny, tmp_path):
    from toolkit import replay
    from toolkit.runs.session import record
    from toolkit.trace.reader import read_requests, read_samples

    engine = make_engine(tiny, max_num_batched_tokens=16, max_num_seqs=4)
    spec = {"choice": ["red", "green", "blue"]}
    ids = [
        engine.add_request(
            prompt_token_ids=[5, 6, 7],
            request_id="c",
            sampling_params=SamplingParams(temperature=1.0, seed=2, max_tokens=8, structured_outputs=spec),
        ),
        engine.add_request(
            prompt_token_ids=[8, 9],
            request_id="plain",
            sampling_params=SamplingParams(temperature=1.0, seed=3, max_tokens=4, ignore_eos=True),
        ),
    ]
    record(engine, ids, tmp_path / "run", {"model": {"name": "tiny"}})
    rows = read_samples(tmp_path / "run").to_pylist()
    mine = [r for r in rows if r["request_id"] == "c"]
    assert all(r["grammar_allowed"] is not None and r["grammar_allowed"] >= 1 for r in mine)
    assert all(r["grammar_allowed"] is None for r in rows if r["request_id"] == "plain")
    assert mine[-1]["stop_reason"] in ("grammar", "eos") and "grammar(choice)" in mine[0]["processors"]
    req = {r["request_id"]: r for r in read_requests(tmp_path / "run").to_pylist()}
    assert req["c"]["grammar_kind"] == "choice" and len(req["c"]["grammar_sha256"]) == 64
    assert req["plain"]["grammar_kind"] is None
    report = replay(tmp_path / "run", out_dir=tmp_path / "replay")
    assert report.identical, report.summary_line()


@pytest.mark.native
def test_an_assertion_inside_xgrammar_is_a_readable_refusal(tiny):
    """A schema pattern of large repetition counts fails an assertion inside xgrammar 0.2.8 (its text named a C++
    member, per_rule_fsm_hashes, and nothing a client could act on): the refusal says the compiler could not build
    it, on one line, and the engine compiles the next grammar."""
    engine = make_engine(tiny)
    schema = {"type": "string", "pattern": "(a|b|c){600}q"}
    try:
        engine.precompile(SamplingParams(structured_outputs={"json": schema}))
    except RequestError as exc:
        message = str(exc)
    else:
        pytest.skip("this xgrammar compiles the pattern (its assertion is gone): no refusal to word")
    assert message.startswith("invalid structured_outputs.json: xgrammar cannot compile it (its internal check"), (
        message
    )
    assert "Check failed" not in message and "\n" not in message, message
    engine.precompile(SamplingParams(structured_outputs={"json": {"type": "string", "pattern": "(a|b){3}"}}))


def test_a_compile_the_machine_refuses_is_a_resource_error_not_the_grammars(tiny):
    """xgrammar's C++ errors carry only their text: one ending in an OS shortage (a thread refused at shutdown:
    EAGAIN) is the machine's, a ResourceError (a server's 503), where it was "invalid structured_outputs.json" (a
    400 blaming the client's schema); any other message is still the grammar's RequestError."""
    import types

    from toolkit.errors import ResourceError
    from toolkit.sampling.grammar import GrammarBackend, StructuredOutputs

    backend = GrammarBackend(tiny.tokenizer, tiny.arch.vocab_size, [0])

    def refusing(text, **kwargs):
        raise RuntimeError(f"[12:00:00] /xgrammar/cpp/compiler.cc:42: {json.loads(text)['title']}")

    backend.compiler = types.SimpleNamespace(compile_json_schema=refusing)  # what xgrammar raises, at its call
    with pytest.raises(ResourceError, match="compiling structured_outputs.json failed: Resource temporarily"):
        backend.compile(StructuredOutputs(json={"title": "Resource temporarily unavailable"}))
    with pytest.raises(RequestError, match="invalid structured_outputs.json: no such keyword"):
        backend.compile(StructuredOutputs(json={"title": "no such keyword"}))


# --- JSON-schema keywords xgrammar accepts but does not enforce: refused, naming the keyword and its path ---

INT = {"type": "integer"}
AB = {"a": INT, "b": INT}
# (schema, the keyword refused, its path, a JSON text breaking it that xgrammar 0.2.8 still accepts)
UNENFORCED = [
    ({"type": "array", "items": INT, "uniqueItems": True}, "uniqueItems", "uniqueItems", "[1,1]"),
    (
        {"type": "object", "properties": {"a": {"type": "integer", "not": {"const": 1}}}, "required": ["a"]},
        "not",
        "properties.a.not",
        '{"a":1}',
    ),
    (
        {
            "type": "array",
            "items": {"type": "object", "properties": AB, "if": {"required": ["a"]}, "then": {"required": ["b"]}},
        },
        "if",
        "items.if",
        '[{"a":1}]',
    ),
    (
        {"$defs": {"d": {"type": "object", "properties": AB, "dependentRequired": {"a": ["b"]}}}, "$ref": "#/$defs/d"},
        "dependentRequired",
        "$defs.d.dependentRequired",
        '{"a":1}',
    ),
    (
        {
            "anyOf": [
                {"type": "object", "properties": AB, "dependentSchemas": {"a": {"required": ["b"]}}},
                {"type": "null"},
            ]
        },
        "dependentSchemas",
        "anyOf.0.dependentSchemas",
        '{"a":1}',
    ),
    ({"type": "object", "properties": AB, "dependencies": {"a": ["b"]}}, "dependencies", "dependencies", '{"a":1}'),
    (
        {"type": "array", "prefixItems": [INT, {"type": "array", "items": INT, "contains": {"const": 5}}]},
        "contains",
        "prefixItems.1.contains",
        "[1,[1]]",
    ),
    (
        {"type": "object", "additionalProperties": {"type": "number", "multipleOf": 0.5}},
        "multipleOf",
        "additionalProperties.multipleOf",
        '{"x":0.3}',
    ),
    ({"type": "integer", "multipleOf": 2.5}, "multipleOf", "multipleOf", "4"),
    ({"allOf": [INT, {"type": "integer", "minimum": 5}]}, "allOf", "allOf", "3"),
    ({"type": "string", "format": "regex"}, "format", "format", '"("'),
    ({"type": "string", "format": "date", "pattern": "^2020"}, "pattern", "pattern", '"2021-01-01"'),
    ({"type": "string", "pattern": "^a+$", "maxLength": 2}, "maxLength", "maxLength", '"aaa"'),
    ({"type": "array", "items": {"minimum": 5}}, "minimum", "items.minimum", "[4]"),
    ({"$defs": {"x": INT}, "$ref": "#/$defs/x", "maximum": 3}, "maximum", "maximum", "5"),
    ({"type": "string", "enum": ["a", 1]}, "type", "type", "1"),
    ({"type": "object", "properties": {"a": INT}, "required": ["a", "b"]}, "required", "required", '{"a":1}'),
    ({"$defs": {"x": {"$anchor": "x", "type": "integer"}}, "$ref": "#x"}, "$ref", "$ref", '"a"'),
    (
        {"$defs": {"x": {"$dynamicAnchor": "x", "type": "integer"}}, "$dynamicRef": "#x"},
        "$dynamicRef",
        "$dynamicRef",
        '"a"',
    ),
    (
        {"components": {"u": {"type": "array", "items": INT, "uniqueItems": True}}, "$ref": "#/components/u"},
        "uniqueItems",
        "components.u.uniqueItems",
        "[1,1]",
    ),
    (
        {"type": "object", "propertyNames": {"format": "date", "maxLength": 3}, "additionalProperties": INT},
        "maxLength",
        "propertyNames.maxLength",
        '{"2020-01-01":1}',
    ),
    ({"type": "string", "pattern": "^(?!a)[ab]{3}$"}, "pattern", "pattern", '"abb"'),  # the lookahead ignored
    ({"type": "string", "pattern": "(?=b)[ab]"}, "pattern", "pattern", '"a"'),
    ({"type": "string", "pattern": "^\\Aab$"}, "pattern", "pattern", '"Aab"'),  # \A matched as the letter
    ({"type": "array", "items": {"type": "string", "pattern": "[(]\\z"}}, "pattern", "items.pattern", '["(z"]'),
    ({"type": []}, "type", "type", "1"),  # any value
    ({"type": "object", "properties": {"a": {"anyOf": []}}}, "anyOf", "properties.a.anyOf", '{"a":}'),  # no JSON
]
# (schema, a JSON text breaking it that xgrammar refuses): kept
ENFORCED = [
    ({"type": "array", "items": INT, "minItems": 2, "maxItems": 3}, "[1]"),
    ({"type": "array", "items": INT, "uniqueItems": False, "minItems": 0}, '["a"]'),
    ({"enum": ["a", 1]}, "2"),
    ({"type": "string", "enum": ["a", "b"]}, '"c"'),
    ({"type": "object", "const": {"a": 1}}, '{"a":2}'),
    ({"type": "string", "pattern": "^a+$"}, '"b"'),
    ({"type": "string", "minLength": 2, "maxLength": 3}, '"abcd"'),
    ({"type": "integer", "minimum": 5, "exclusiveMaximum": 9}, "9"),
    ({"type": "number", "exclusiveMinimum": 1.5}, "1.5"),
    ({"type": ["integer", "null"], "multipleOf": 3}, "4"),
    ({"type": "array", "prefixItems": [INT, {"type": "string"}], "items": False}, '[1,"a",2]'),
    ({"type": "object", "properties": {"a": INT}, "additionalProperties": False, "required": ["a"]}, "{}"),
    ({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}, "additionalProperties": INT}, '{"A":1}'),
    ({"type": "object", "patternProperties": {"^x.*$": INT}, "maxProperties": 1}, '{"xa":"s"}'),
    ({"type": "object", "properties": AB, "minProperties": 2}, '{"a":1}'),
    ({"type": "object", "properties": {"a": INT}, "unevaluatedProperties": False}, '{"a":1,"b":2}'),
    ({"type": "string", "format": "date"}, '"x"'),
    ({"allOf": [{"type": "integer", "minimum": 5}]}, "3"),
    ({"anyOf": [INT, {"type": "string", "maxLength": 1}]}, '"ab"'),
    ({"oneOf": [INT, {"type": "string"}]}, "true"),
    ({"$defs": {"x": {"type": "integer", "maximum": 3}}, "$ref": "#/$defs/x"}, "5"),
    ({"type": "integer", "if": {"minimum": 0}}, '"a"'),  # an `if` without then / else does nothing
]


def _xgrammar_accepts(schema: dict, text: str) -> bool:
    """Whether xgrammar, compiled as GrammarBackend compiles a schema, takes `text` as a whole output."""
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False)
    compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=True, max_whitespace_cnt=16)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


@pytest.mark.parametrize("schema, keyword, path, text", UNENFORCED, ids=[f"{c[2]}" for c in UNENFORCED])
def test_a_keyword_xgrammar_does_not_enforce_is_refused_naming_its_path(schema, keyword, path, text):
    """xgrammar compiles these schemas and then lets through an output that breaks them (the text here): a 200
    whose output the schema refuses. StructuredOutputs refuses the schema, in one line naming the keyword and its
    place. If a later xgrammar enforces one, the last check fails: then drop it from toolkit/sampling/unenforced.py."""
    with pytest.raises(ConfigError) as info:
        SamplingParams(structured_outputs={"json": schema})
    message = str(info.value)
    assert message.startswith(f"invalid structured_outputs.json: {keyword!r} at {path} is not enforced by the ")
    assert "grammar engine (xgrammar" in message and "remove it or check the output yourself" in message
    assert "\n" not in message
    with pytest.raises(ConfigError, match="is not enforced"):
        StructuredOutputs(json=json.dumps(schema))  # as text too
    assert _xgrammar_accepts(schema, text), f"xgrammar now enforces {keyword!r}: stop refusing it"


@pytest.mark.parametrize("schema, text", ENFORCED, ids=[json.dumps(c[0])[:40] for c in ENFORCED])
def test_a_keyword_xgrammar_enforces_is_kept(schema, text):

    assert StructuredOutputs(json=schema).json == schema
    assert not _xgrammar_accepts(schema, text)


def test_a_property_named_like_a_keyword_is_a_name_not_a_keyword():
    """`properties` maps names to schemas: a property called "not" or "uniqueItems" is a name; a const, enum or
    default holds data, whatever its keys."""

    names = ["not", "uniqueItems", "if", "contains", "allOf", "multipleOf", "$ref", "$dynamicRef", "dependencies"]
    schema = {
        "type": "object",
        "properties": {name: {"type": "string"} for name in names}
        | {"data": {"const": {"not": {"uniqueItems": True}}, "default": {"allOf": [1, 2]}}},
        "required": names,
        "patternProperties": {"^not$": INT},
        "$defs": {"uniqueItems": {"type": "object", "properties": {"not": INT}}},
    }
    assert StructuredOutputs(json=schema).json == schema
    assert _xgrammar_accepts(schema, json.dumps(dict.fromkeys(names, "x"), separators=(",", ":")))
    assert not _xgrammar_accepts(schema, json.dumps({**dict.fromkeys(names, "x"), "not": 1}))


def test_a_deeply_nested_schema_is_walked_without_recursion():
    """A hostile schema may nest past Python's recursion limit: the walk is a loop (its path cut to its last 200
    characters), and StructuredOutputs refuses what json cannot copy in one line, never a RecursionError."""

    def nested(depth: int, inner: dict) -> dict:
        for _ in range(depth):
            inner = {"items": inner}
        return inner

    keyword, path, _ = unenforced_keyword(nested(5000, {"type": "array", "uniqueItems": True}))
    assert keyword == "uniqueItems" and path == "..." + ("items." * 5000 + "uniqueItems")[-200:]
    assert unenforced_keyword(nested(100_000, {"type": "array", "minItems": 1})) is None
    for schema in (nested(5000, INT), '{"items":' * 5000 + '{"type":"integer"}' + "}" * 5000):
        with pytest.raises(ConfigError, match="^invalid structured_outputs.json: it is nested too deeply to be read$"):
            StructuredOutputs(json=schema)


WRAPPERS = st.one_of(
    st.tuples(st.just("properties"), st.sampled_from(["not", "uniqueItems", "if", "items", "x"]) | st.text(max_size=6)),
    st.tuples(st.just("$defs"), st.sampled_from(["not", "allOf", "d"])),
    st.tuples(st.sampled_from(["anyOf", "prefixItems"]), st.integers(0, 2)),
    st.tuples(st.sampled_from(["items", "additionalProperties"])),
)


PLACEABLE = [case for case in UNENFORCED if '"#/' not in json.dumps(case[0])]  # no pointer from the root it moves


def _wrap(schema: dict, wrappers: list[tuple]) -> dict:
    """`schema` placed where each wrapper (outermost first) reads a schema; its siblings enforced ones."""
    for wrapper in reversed(wrappers):
        key, *at = wrapper
        if key in ("properties", "$defs"):
            schema = {"type": "object", key: {at[0]: schema}}
        elif key == "anyOf":
            schema = {"anyOf": [{"type": "null"}] * at[0] + [schema]}
        elif key == "prefixItems":
            schema = {"type": "array", "prefixItems": [INT] * at[0] + [schema]}
        else:
            schema = {"type": "array" if key == "items" else "object", key: schema}
    return schema


@settings(max_examples=60, deadline=None)
@given(wrappers=st.lists(WRAPPERS, max_size=5), case=st.sampled_from(PLACEABLE), kept=st.sampled_from(ENFORCED))
def test_a_refusal_names_the_keyword_wherever_it_is_placed(wrappers, case, kept):
    """Wherever xgrammar reads a schema (a property of any name, $defs, anyOf / prefixItems branches, items,
    additionalProperties), an unenforced keyword in it is refused with the path to it; an enforced one is kept."""

    schema, keyword, path, _ = case
    full = ".".join([str(part) for wrapper in wrappers for part in wrapper] + [path])
    assert unenforced_keyword(_wrap(schema, wrappers)) == (
        keyword,
        full if len(full) <= 200 else "..." + full[-200:],
        unenforced_keyword(schema)[2],
    )
    assert unenforced_keyword(_wrap(kept[0], wrappers)) is None


# regex pieces whole in themselves, in which a lookahead or an unknown escape only seems to stand
SAFE_REGEX = ["a", "b*", "[(?=]", "[x(?!]", "\\(?=", "\\(?!", "(?:ab)", "\\\\", "[\\]A]", "x{2}", "\\d", "[\\\\]"]


@given(st.lists(st.sampled_from(SAFE_REGEX), max_size=8), st.sampled_from(["(?=a)", "(?!a)", "\\A", "\\z"]), st.data())
def test_a_regex_construct_xgrammar_ignores_is_found_wherever_it_stands_and_nowhere_else(pieces, bad, data):
    """xgrammar compiles a lookahead in a JSON-schema pattern by dropping it ("^(?!a)[ab]{3}$" yields "abb") and
    \\A, \\z, ... as the letter: ignored_in_regex finds one wherever it stands, never one inside a class or after
    an escape; a regex output with one is refused too."""
    assert ignored_in_regex("".join(pieces)) is None
    at = data.draw(st.integers(0, len(pieces)))
    pattern = "".join(pieces[:at]) + bad + "".join(pieces[at:])
    assert ignored_in_regex(pattern) is not None, pattern
    with pytest.raises(ConfigError, match="invalid structured_outputs.regex: xgrammar ignores the "):
        StructuredOutputs(regex=pattern)
    with pytest.raises(ConfigError, match="'pattern' at properties.p.pattern is not enforced"):
        StructuredOutputs(json={"type": "object", "properties": {"p": {"type": "string", "pattern": pattern}}})
