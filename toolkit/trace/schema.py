"""The trace schema: one `SampleTrace` row per sampled token, one row per request.

Versioned: readers refuse a trace whose `schema_version` they do not know. See
docs/trace-schema.md for the meaning of every column.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, fields
from typing import Any

import pyarrow as pa

SCHEMA_VERSION = 7

# older versions this toolkit still reads, and what their tables lack (read as null)
COMPATIBLE = {
    4: {
        "requests": (
            "request_body",
            "abort_step",
            "origin_engine",
            "source_record",
            "arrival_index",
            "request_body_sha256",
        ),
        "samples": ("kept_sha256",),
    },
    5: {
        "requests": ("origin_engine", "source_record", "arrival_index", "request_body_sha256"),
        "samples": ("kept_sha256",),
    },
    6: {"requests": ("arrival_index", "request_body_sha256"), "samples": ()},
}

# versions this toolkit no longer reads, and why (the reader says so instead of "unknown version")
SUPERSEDED = {
    3: "its Gumbel noise was computed with torch.log, whose last bit depends on the CPU and on a token's "
    "place in the row; version 4 computes -log(-log(u)) with toolkit's own logarithm (identical bits "
    "everywhere), so about 1 noise value in 7 differs by an ulp and a sampled token near a tie could "
    "differ: it cannot be replayed bit for bit (replay it with the toolkit commit that wrote it)",
}

# the float columns compared by their bits (replay, the report): struct formats of their stored width
FLOAT_BITS = {"raw_logprob": "<f", "processed_logprob": "<f", "noise": "<d", "draft_logprob": "<f"}
TOP_COLUMNS = ("top_raw", "top_processed")  # lists of {token_id, logprob}: compared id by id and by fp32 bits


def same_value(name: str, a: Any, b: Any) -> bool:
    """Whether two values of one sample column are the same: the float columns by their bits (a NaN equals the
    same NaN), the others by ==."""
    if name in FLOAT_BITS and isinstance(a, float) and isinstance(b, float):
        return struct.pack(FLOAT_BITS[name], a) == struct.pack(FLOAT_BITS[name], b)
    if name in TOP_COLUMNS and isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(
            x["token_id"] == y["token_id"] and same_value("raw_logprob", x["logprob"], y["logprob"])
            for x, y in zip(a, b)
        )
    return a == b


TOP_TYPE = pa.list_(pa.struct([("token_id", pa.int64()), ("logprob", pa.float32())]))


@dataclass(frozen=True)
class SampleTrace:
    """Everything needed to audit and replay one sampling decision."""

    request_id: str
    stream: int  # sample index of the request (RNG stream)
    step: int  # engine step that sampled it
    position: int  # position of the token in its sequence (prompt tokens are 0..P-1)
    token_id: int  # -1 on an error row (nothing could be sampled)
    raw_logprob: float  # log softmax(raw logits)[token]
    processed_logprob: float  # log softmax(processed logits)[token]: the policy's probability
    support_size: int  # tokens with a finite processed logit
    top_raw: tuple[tuple[int, float], ...]  # top `logprobs` alternatives under the raw distribution
    top_processed: tuple[tuple[int, float], ...]
    processors: tuple[str, ...]  # active processors, in order, with their parameters
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    noise: float  # Gumbel noise of the chosen token (NaN when greedy)
    batch_size: int  # sequences in the step's forward
    step_tokens: int  # tokens in the step's forward (decodes + prefill chunks)
    finish_reason: str | None  # on the request's last row
    stop_reason: str | None  # what ended it: eos, stop_token_id:<id>, stop_str:<s>, max_tokens, ...
    error: str | None  # why nothing could be sampled (finish_reason "error")
    t_emit_s: float  # seconds since the run started
    logits_row: int  # row of the step's logits tensor (not stored: the writer digests it)
    grammar_allowed: int | None = None  # tokens the request's grammar allowed at this position (no grammar: null)
    origin: str = "plain"  # plain | draft_accepted | resampled | bonus (speculative decoding)
    draft_logprob: float | None = None  # the draft's processed logprob of this token (null: none proposed it)
    spec_proposed: int = 0  # drafts proposed for this sequence in this step
    spec_accepted: int = 0  # of which kept
    kept_sha256: str | None = None  # sha256 of the kept set: the tokens with a finite processed logit, as a bitmask

    @classmethod
    def from_fields(cls, values: dict[str, Any]) -> SampleTrace:
        """The row of `values` (every field by name, no other name; the dict becomes the row's and must not be used
        again): what `SampleTrace(**values)` gives, equal, hashed and frozen alike, without the frozen __init__'s
        one `object.__setattr__` a field. The engine builds one a sampled token (issue 56: at batch 32 the frozen
        __init__ was 0.23 ms of a step's host time on an AMD EPYC, 7.3 us a row against 2.2)."""
        if values.keys() != _TRACE_FIELDS:
            missing, extra = sorted(_TRACE_FIELDS - values.keys()), sorted(values.keys() - _TRACE_FIELDS)
            raise TypeError(f"SampleTrace fields missing {missing}, unknown {extra}")
        row = object.__new__(cls)
        object.__setattr__(row, "__dict__", values)
        return row


_TRACE_FIELDS = frozenset(f.name for f in fields(SampleTrace))


SAMPLE_COLUMNS = [
    ("run_id", pa.string()),
    ("request_id", pa.string()),
    ("stream", pa.int32()),
    ("step", pa.int64()),
    ("position", pa.int64()),
    ("token_id", pa.int64()),
    ("raw_logprob", pa.float32()),
    ("processed_logprob", pa.float32()),
    ("support_size", pa.int64()),
    ("top_raw", TOP_TYPE),
    ("top_processed", TOP_TYPE),
    ("processors", pa.list_(pa.string())),
    ("temperature", pa.float32()),
    ("top_k", pa.int32()),
    ("top_p", pa.float32()),
    ("min_p", pa.float32()),
    ("seed", pa.int64()),
    ("noise", pa.float64()),
    ("logits_sha256", pa.string()),
    ("batch_size", pa.int32()),
    ("step_tokens", pa.int32()),
    ("finish_reason", pa.string()),
    ("stop_reason", pa.string()),
    ("error", pa.string()),
    ("t_emit_s", pa.float64()),
    ("grammar_allowed", pa.int64()),
    ("origin", pa.string()),
    ("draft_logprob", pa.float32()),
    ("spec_proposed", pa.int32()),
    ("spec_accepted", pa.int32()),
    ("kept_sha256", pa.string()),
]
SAMPLES_SCHEMA = pa.schema(SAMPLE_COLUMNS, metadata={"toolkit_schema_version": str(SCHEMA_VERSION)})

REQUESTS_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("request_id", pa.string()),
        ("stream", pa.int32()),
        ("prompt_token_ids", pa.list_(pa.int64())),
        ("prompt_text", pa.string()),
        ("sampling_params", pa.string()),  # JSON of the resolved SamplingParams
        ("seed", pa.int64()),
        ("arrival_step", pa.int64()),
        ("admitted_step", pa.int64()),
        ("output_token_ids", pa.list_(pa.int64())),
        ("output_text", pa.string()),
        ("finish_reason", pa.string()),
        ("stop_reason", pa.string()),
        ("num_preemptions", pa.int32()),
        ("preempted_steps", pa.list_(pa.int64())),
        ("preemption_modes", pa.list_(pa.string())),  # recompute | swap, one per preemption
        ("priority", pa.int64()),
        ("grammar_kind", pa.string()),  # json | regex | grammar | choice (null without structured outputs)
        ("grammar_sha256", pa.string()),  # digest of the grammar's canonical text
        ("queue_s", pa.float64()),
        ("ttft_s", pa.float64()),
        ("tpot_s", pa.float64()),
        ("e2e_s", pa.float64()),
        ("request_body", pa.string()),  # the HTTP request body as received (served runs; null otherwise)
        ("abort_step", pa.int64()),  # the step before which the request was aborted (a client left); null otherwise
        (
            "origin_engine",
            pa.string(),
        ),  # the engine that produced a converted transcript (mode=audit); null: this toolkit
        ("source_record", pa.string()),  # the transcript line it was converted from, as read (mode=audit)
        ("arrival_index", pa.int64()),  # the request's place in the run's arrival order (null: a converted transcript)
        ("request_body_sha256", pa.string()),  # sha256 of the HTTP body as received (served runs, whatever record_body)
    ],
    metadata={"toolkit_schema_version": str(SCHEMA_VERSION)},
)

REJECTED_SCHEMA = pa.schema(
    [  # a served run's requests refused (503: serve.max_waiting) or failed (500)
        ("run_id", pa.string()),
        ("request_id", pa.string()),  # the HTTP response's id (cmpl-..., chatcmpl-...) or the engine request's
        ("route", pa.string()),
        ("status", pa.int32()),
        ("reason", pa.string()),
        ("step", pa.int64()),  # the engine's step when it was refused
        ("time", pa.float64()),  # unix seconds
        ("request_body_sha256", pa.string()),
    ],
    metadata={"toolkit_schema_version": str(SCHEMA_VERSION)},
)

TRACE_FIELDS = [f.name for f in fields(SampleTrace) if f.name != "logits_row"]
