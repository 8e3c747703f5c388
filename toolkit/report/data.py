"""What a report shows, read from a run directory: per sequence its token rows as columns, the engine's steps,
the manifest and summary; between two runs, each sequence's first divergence and its cause.

A sampled token's logprobs are carried as the shortest decimal that reads back to the same float32, its noise as
the float64 itself, so the page shows the trace's values, not roundings of them (the alternatives' logprobs to 6
significant digits, emit times to the microsecond).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from toolkit.trace.diverge import SeqKey, sequences
from toolkit.trace.reader import (
    check_rows_present,
    read_manifest,
    read_requests,
    read_samples,
    read_steps,
    read_summary,
)


def f32(x: float | None) -> float | None:
    """The shortest decimal that reads back to the same float32; None for null, NaN and infinities (JSON has none
    of them: the page shows them as absent)."""
    if x is None or not math.isfinite(x):
        return None
    return float(str(np.float32(x)))


def f64(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else x


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
                try:
                    self.table[t] = self.tokenizer.decode([t], skip_special_tokens=False)
                except (OverflowError, ValueError, IndexError):  # no such token (a corrupt trace): its id
                    self.table[t] = f"#{t}"


def _top(entries) -> list | None:
    """[[ids], [logprobs]] of a top list (None when empty); the alternatives' logprobs to 6 significant digits
    (what the page shows of them: a 100,000-row run with 5 + 5 alternatives a token stays under 20 MB)."""
    if not entries:
        return None
    return [
        [e["token_id"] for e in entries],
        [
            None if e["logprob"] is None or not math.isfinite(e["logprob"]) else float(f"{e['logprob']:.6g}")
            for e in entries
        ],
    ]


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
        "t": [
            None if r["t_emit_s"] is None or not math.isfinite(r["t_emit_s"]) else round(r["t_emit_s"], 6) for r in rows
        ],
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
        out.append(
            {
                "id": r["request_id"],
                "stream": r["stream"],
                "tokens": len(rows),
                "prompt": _tail(r["prompt_text"] or "", 4000),  # its end, which the output continues
                "prompt_tokens": len(r["prompt_token_ids"] or ()),
                "finish": r["finish_reason"],
                "stop": r["stop_reason"],
                "mean_raw_lp": f32(sum(lps) / len(lps)) if lps else None,
                "min_raw_lp": f32(min(lps)) if lps else None,
                "ttft": f64(r["ttft_s"]),
                "tpot": f64(r["tpot_s"]),
                "preemptions": r["num_preemptions"],
                "temperature": params.get("temperature"),
                "top_p": params.get("top_p"),
                "top_k": params.get("top_k"),
                "seed": None if r["seed"] is None else str(r["seed"]),  # 64-bit: a JS number would round it
                "origin_engine": r.get("origin_engine"),
            }
        )
    known = {(e["id"], e["stream"]) for e in out}
    for key in sorted(set(seqs) - known):  # rows of a sequence without a request row (a cut trace)
        out.append(
            {
                "id": key[0],
                "stream": key[1],
                "tokens": len(seqs[key]),
                "prompt": "",
                "prompt_tokens": 0,
                "finish": None,
                "stop": None,
                "mean_raw_lp": None,
                "min_raw_lp": None,
                "ttft": None,
                "tpot": None,
                "preemptions": None,
                "temperature": None,
                "top_p": None,
                "top_k": None,
                "seed": None,
                "origin_engine": None,
            }
        )
    return out


def _tail(text: str, n: int) -> str:
    """The last `n` characters of `text`, marked where the start was cut (it was cut without a word)."""
    return text if len(text) <= n else f"[{len(text) - n + 1} characters before] …" + text[-(n - 1) :]


def finite(value: Any) -> Any:
    """`value` with every NaN or infinity in it as None: JSON has no such numbers, and Python's writes them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    return [finite(v) for v in value] if isinstance(value, list) else value


def notes(run: RunData) -> list[str]:
    """What the page says first about the run as a whole: stopped early, failed, requests refused."""
    s = run.summary or {}
    out = []
    if s.get("interrupted"):
        out.append(
            f"This run was interrupted ({s.get('signal') or 'Ctrl-C'}): the requests still running then stop short."
        )
    if s.get("failed"):
        out.append(f"This run failed: {s['failed']}")
    if not s:
        out.append("This run has no summary.json: it did not close (killed?); its figures are the rows it wrote.")
    rejected = s.get("rejected") or 0
    if rejected:
        reasons = "; ".join(str(r) for r in (s.get("rejected_requests") or [])[:3])
        out.append(f"{rejected} request(s) were rejected and are not shown" + (f": {reasons}" if reasons else ""))
    return out


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
        samples, steps, requests = read_samples(run_dir), read_steps(run_dir), read_requests(run_dir)
        check_rows_present(requests, samples, run_dir)  # what replay and compare refuse (rows lost) is refused here
        return cls(
            run_dir=run_dir,
            manifest=finite(read_manifest(run_dir)),
            summary=finite(read_summary(run_dir)) or None,
            config_yaml=config.read_text() if config.exists() else "",
            requests=requests,
            seqs=sequences(samples.to_pylist()),
            steps=steps.to_pydict() if steps is not None else None,
        )

    @property
    def rows(self) -> int:
        return sum(len(v) for v in self.seqs.values())

    def payload(self, pieces: Pieces, processors: dict[tuple, int]) -> dict[str, Any]:
        entries = request_entries(self.requests, self.seqs)
        return {
            "dir": str(self.run_dir),
            "manifest": self.manifest,
            "summary": self.summary,
            "config": self.config_yaml,
            "rows": self.rows,
            "requests": entries,
            "seqs": [sequence_columns(self.seqs.get((e["id"], e["stream"]), []), processors, pieces) for e in entries],
        }
