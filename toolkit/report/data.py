"""What a report shows, read from a run directory: per sequence its token rows as columns, the engine's steps,
the manifest and summary; between two runs, each sequence's first divergence and its cause.

A sampled token's logprobs are carried as the shortest decimal that reads back to the same float32, its noise as
the float64 itself, so the page shows the trace's values, not roundings of them (the alternatives' logprobs to 6
significant digits, emit times to the microsecond).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from toolkit.trace.reader import read_manifest, read_requests, read_samples
from toolkit.trace.schema import same_value

SeqKey = tuple[str, int]  # (request_id, stream)

# the fields whose difference names the first divergence, and the cause each points to, checked in this order
# at the first differing position: what comes first in the pipeline (the forward) explains what follows
CAUSES = (
    ("logits", "numerical: the raw logits differ (logits_sha256), so the forward computed other bits"),
    ("support", "processors or grammar: the same logits, but another kept set (kept_sha256 / support_size)"),
    ("noise", "sampling noise: the same logits and kept set, other Gumbel noise (seed, position or stream)"),
    ("token", "sampling: the same logits, kept set and noise, but another token"),
    ("logprob", "numerical: the same token, other logprob bits"),
    ("finish", "stopping: the same token, another finish or error"),
    ("length", "length: one run has no row at this position (it stopped earlier, or its trace was cut)"),
)
CAUSE_TEXT = dict(CAUSES)


def f32(x: float | None) -> float | None:
    """The shortest decimal that reads back to the same float32; None for null, NaN and infinities (JSON has none
    of them: the page shows them as absent)."""
    if x is None or not math.isfinite(x):
        return None
    return float(str(np.float32(x)))


def f64(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else x


@dataclass(frozen=True)
class Divergence:
    """Where two runs' rows of one sequence first differ, and why."""

    request_id: str
    stream: int
    position: int
    index: int  # the row's index in the sequence's output (0 = the first sampled token)
    kind: str  # a key of CAUSES
    fields: tuple[str, ...]  # the trace columns that differ there
    a_token: int | None
    b_token: int | None
    token_index: int | None = None  # the first output token whose id differs (None: every shared token agrees)

    @property
    def cause(self) -> str:
        return CAUSE_TEXT[self.kind]

    def to_dict(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "stream": self.stream, "position": self.position,
                "index": self.index, "kind": self.kind, "cause": self.cause, "fields": list(self.fields),
                "a_token": self.a_token, "b_token": self.b_token, "token_index": self.token_index}


def differing_fields(a: dict[str, Any], b: dict[str, Any]) -> tuple[str, ...]:
    """The compared trace columns in which two rows of the same (sequence, position) differ, floats by bits (as
    replay compares them); a digest either run did not record (null) is not compared."""
    return tuple(name for name in ("logits_sha256", "kept_sha256", "support_size", "noise", "token_id",
                                   "raw_logprob", "processed_logprob", "finish_reason", "error")
                 if not (name.endswith("sha256") and (a.get(name) is None or b.get(name) is None))
                 and not same_value(name, a.get(name), b.get(name)))


def cause_of(fields: Sequence[str]) -> str:
    """The cause a set of differing fields points to (a key of CAUSES)."""
    f = set(fields)
    if "logits_sha256" in f:
        return "logits"
    if f & {"kept_sha256", "support_size"}:
        return "support"
    if "noise" in f:
        return "noise"
    if "token_id" in f:
        return "token"
    if f & {"raw_logprob", "processed_logprob"}:
        return "logprob"
    return "finish"


def first_divergences(a: dict[SeqKey, list[dict]], b: dict[SeqKey, list[dict]]) -> list[Divergence]:
    """For each sequence of either run, the first position where their rows differ (rows by position), and the
    first output token whose id differs."""
    out = []
    for key in sorted(set(a) | set(b)):
        rows_a = {r["position"]: r for r in a.get(key, [])}
        rows_b = {r["position"]: r for r in b.get(key, [])}
        positions = sorted(set(rows_a) | set(rows_b))
        tokens = [(rows_a[p]["token_id"] if p in rows_a else None, rows_b[p]["token_id"] if p in rows_b else None)
                  for p in positions]
        token_index = next((i for i, (x, y) in enumerate(tokens) if x != y and x is not None and y is not None),
                           None)
        for index, position in enumerate(positions):
            x, y = rows_a.get(position), rows_b.get(position)
            kind, fields = ("length", ("row",)) if x is None or y is None else (None, differing_fields(x, y))
            if kind or fields:
                out.append(Divergence(key[0], key[1], position, index, kind or cause_of(fields), fields,
                                      *tokens[index], token_index=token_index))
                break
    return out


def sequences(samples: pa.Table) -> dict[SeqKey, list[dict]]:
    """Each sequence's rows, by position."""
    out: dict[SeqKey, list[dict]] = {}
    for r in samples.to_pylist():
        out.setdefault((r["request_id"], r["stream"]), []).append(r)
    for rows in out.values():
        rows.sort(key=lambda r: r["position"])
    return out


class Pieces:
    """Token id -> the text it spells, for the ids a report uses (or `#<id>` without a tokenizer)."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self.table: dict[int, str] = {}

    def add(self, ids: Iterable[int]) -> None:
        for t in ids:
            if t is None or t in self.table:
                continue
            if t < 0:
                self.table[t] = ""
            elif self.tokenizer is None:
                self.table[t] = f"#{t}"
            else:
                self.table[t] = self.tokenizer.decode([t], skip_special_tokens=False)


def _top(entries) -> list | None:
    """[[ids], [logprobs]] of a top list (None when empty); the alternatives' logprobs to 6 significant digits
    (what the page shows of them: a 100,000-row run with 5 + 5 alternatives a token stays under 20 MB)."""
    if not entries:
        return None
    return [[e["token_id"] for e in entries],
            [None if e["logprob"] is None or not math.isfinite(e["logprob"]) else float(f"{e['logprob']:.6g}")
             for e in entries]]


def sequence_columns(rows: list[dict], processors: dict[tuple, int], pieces: Pieces) -> dict[str, Any]:
    """One sequence's rows as columns; optional columns only where some row has a value."""
    pieces.add(r["token_id"] for r in rows)
    for r in rows:
        pieces.add(e["token_id"] for e in (r["top_raw"] or ()))
        pieces.add(e["token_id"] for e in (r["top_processed"] or ()))
    cols: dict[str, Any] = {
        "pos": [r["position"] for r in rows],
        "tok": [r["token_id"] for r in rows],
        "raw": [f32(r["raw_logprob"]) for r in rows],
        "proc": [f32(r["processed_logprob"]) for r in rows],
        "sup": [r["support_size"] for r in rows],
        "noise": [f64(r["noise"]) for r in rows],
        "step": [r["step"] for r in rows],
        "batch": [r["batch_size"] for r in rows],
        "stok": [r["step_tokens"] for r in rows],
        "t": [None if r["t_emit_s"] is None or not math.isfinite(r["t_emit_s"]) else round(r["t_emit_s"], 6) for r in rows],
        "dig": [(r["logits_sha256"] or "")[:12] for r in rows],
        "pr": [processors.setdefault(tuple(r["processors"] or ()), len(processors)) for r in rows],
    }
    optional = {
        "tr": [_top(r["top_raw"]) for r in rows],
        "tp": [_top(r["top_processed"]) for r in rows],
        "ga": [r["grammar_allowed"] for r in rows],
        "origin": [None if r["origin"] in (None, "plain") else r["origin"] for r in rows],
        "dl": [f32(r["draft_logprob"]) for r in rows],
        "sp": [r["spec_proposed"] or None for r in rows],
        "sa": [r["spec_accepted"] if r["spec_proposed"] else None for r in rows],
        "err": [r["error"] for r in rows],
        "fin": [r["finish_reason"] for r in rows],
        "stop": [r["stop_reason"] for r in rows],
    }
    for name, values in optional.items():
        if any(v is not None for v in values):
            cols[name] = values
    return cols


def request_entries(requests: pa.Table, seqs: dict[SeqKey, list[dict]]) -> list[dict[str, Any]]:
    """One entry per sequence: what the request list shows."""
    out = []
    for r in requests.to_pylist():
        key = (r["request_id"], r["stream"])
        rows = seqs.get(key, [])
        lps = [x["raw_logprob"] for x in rows if x["raw_logprob"] is not None and math.isfinite(x["raw_logprob"])]
        try:
            params = json.loads(r["sampling_params"] or "{}")
        except json.JSONDecodeError:
            params = {}
        out.append({
            "id": r["request_id"], "stream": r["stream"], "tokens": len(rows),
            "prompt": (r["prompt_text"] or "")[-4000:], "prompt_tokens": len(r["prompt_token_ids"] or ()),
            "finish": r["finish_reason"], "stop": r["stop_reason"],
            "mean_raw_lp": f32(sum(lps) / len(lps)) if lps else None,
            "min_raw_lp": f32(min(lps)) if lps else None,
            "ttft": f64(r["ttft_s"]), "tpot": f64(r["tpot_s"]), "preemptions": r["num_preemptions"],
            "temperature": params.get("temperature"), "top_p": params.get("top_p"), "top_k": params.get("top_k"),
            "seed": None if r["seed"] is None else str(r["seed"]),  # 64-bit: a JS number would round it
            "origin_engine": r.get("origin_engine"),
        })
    known = {(e["id"], e["stream"]) for e in out}
    for key in sorted(set(seqs) - known):  # rows of a sequence without a request row (a cut trace)
        out.append({"id": key[0], "stream": key[1], "tokens": len(seqs[key]), "prompt": "", "prompt_tokens": 0,
                    "finish": None, "stop": None, "mean_raw_lp": None, "min_raw_lp": None, "ttft": None,
                    "tpot": None, "preemptions": None, "temperature": None, "top_p": None, "top_k": None,
                    "seed": None, "origin_engine": None})
    return out


def read_steps(run_dir: Path) -> dict[str, list] | None:
    path = Path(run_dir) / "steps.parquet"
    return pq.read_table(path).to_pydict() if path.exists() else None


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


@dataclass
class RunData:
    """One run directory, read for a report."""

    run_dir: Path
    manifest: dict[str, Any]
    summary: dict[str, Any] | None
    config_yaml: str
    requests: pa.Table
    seqs: dict[SeqKey, list[dict]]
    steps: dict[str, list] | None

    @classmethod
    def read(cls, run_dir: str | Path) -> RunData:
        run_dir = Path(run_dir)
        config = run_dir / "config.yaml"
        samples = read_samples(run_dir)
        return cls(run_dir=run_dir, manifest=read_manifest(run_dir), summary=read_json(run_dir / "summary.json"),
                   config_yaml=config.read_text() if config.exists() else "", requests=read_requests(run_dir),
                   seqs=sequences(samples), steps=read_steps(run_dir))

    @property
    def rows(self) -> int:
        return sum(len(v) for v in self.seqs.values())

    def payload(self, pieces: Pieces, processors: dict[tuple, int]) -> dict[str, Any]:
        entries = request_entries(self.requests, self.seqs)
        return {"dir": str(self.run_dir), "manifest": self.manifest, "summary": self.summary,
                "config": self.config_yaml, "rows": self.rows, "requests": entries,
                "seqs": [sequence_columns(self.seqs.get((e["id"], e["stream"]), []), processors, pieces)
                         for e in entries]}
