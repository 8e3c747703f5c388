"""Read a run directory's trace back, refusing what it cannot trust with a one-line error."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from omegaconf import DictConfig, OmegaConf

from toolkit.config import is_int, is_number
from toolkit.errors import ToolkitError, one_line
from toolkit.trace.schema import (
    COMPATIBLE,
    REJECTED_SCHEMA,
    REQUESTS_SCHEMA,
    SAMPLES_SCHEMA,
    SCHEMA_VERSION,
    SUPERSEDED,
)
from toolkit.trace.writer import (
    MANIFEST_FILE,
    OPEN_REQUESTS_FILE,
    REJECTED_DIR,
    REQUESTS_FILE,
    SAMPLES_DIR,
    STEPS_DIR,
)


class TraceError(ToolkitError):
    """A trace directory is missing, from another schema version, truncated or corrupt."""


def read_manifest(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / MANIFEST_FILE
    if not Path(run_dir).is_dir():
        raise TraceError(f"trace directory {str(run_dir)!r} does not exist")
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise TraceError(f"{path} is missing: not a toolkit run directory") from None
    except (OSError, ValueError) as exc:
        raise TraceError(f"{path} is unreadable or corrupt: {exc}") from None
    if not isinstance(manifest, dict):
        raise TraceError(f"{path} is corrupt: a JSON {type(manifest).__name__}, not an object")
    version = manifest.get("schema_version")
    if not is_int(version):  # a list or object is no version (nor hashable)
        raise TraceError(f"{path}: trace schema version {version!r} is no integer: a corrupt manifest")
    if version in SUPERSEDED:
        raise TraceError(
            f"{path}: trace schema version {version}, this toolkit reads version {SCHEMA_VERSION}: "
            f"{SUPERSEDED[version]}"
        )
    if version != SCHEMA_VERSION and version not in COMPATIBLE:
        raise TraceError(f"{path}: trace schema version {version!r}, this toolkit reads version {SCHEMA_VERSION}")
    _check_fields(manifest, MANIFEST_FIELDS, path)
    return manifest


# what each manifest field a reader uses must be, where it is not null: replay's and verify's checks compare and
# print them (a dtype of [1] was verify's TypeError traceback, a kv_scale_granularity of [1] replay's)
MANIFEST_FIELDS = {
    **dict.fromkeys(
        (
            "run_id",
            "model_name",
            "model_id",
            "weights_sha256",
            "tokenizer_sha256",
            "dtype",
            "kv_cache_dtype",
            "kv_scale_granularity",
            "matmul_backend",
            "kernel_numerics",
            "native_kernels",
            "kernel_target",
            "record_body",
        ),
        "a string",
    ),
    "batch_invariant": "true or false",
}


def _check_fields(document: dict[str, Any], fields: dict[str, str], path: Path) -> None:
    """A TraceError naming the first of `fields` (name: kind, _is_kind's) that `document` holds as another kind."""
    for key, kind in fields.items():
        value = document.get(key)
        if value is not None and not _is_kind(value, kind):
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise TraceError(f"{path} is corrupt: {key} is {shown}, not {kind}")


def read_config(run_dir: Path) -> DictConfig:
    """The run's resolved config (config.yaml): what rebuilds its engine."""
    path = Path(run_dir) / "config.yaml"
    try:
        cfg = OmegaConf.load(path)
    except FileNotFoundError:
        raise TraceError(f"{path} is missing: cannot rebuild the engine of this run") from None
    except Exception as exc:  # noqa: BLE001 - yaml errors come in many types
        raise TraceError(f"{path} is unreadable: {exc}") from None
    try:  # a recorded config is resolved: an interpolation in it (${nope}, ${oc.env:X}) is an edit that may not resolve
        OmegaConf.resolve(cfg)
    except Exception as exc:  # noqa: BLE001 - omegaconf's interpolation errors come in many types
        raise TraceError(f"{path} holds an interpolation that does not resolve: {one_line(exc)}") from None
    # every run records its whole config, the model and engine it ran among it (runs.recorder.effective_config):
    # without them a replay rebuilt the default engine and blamed the weights, and verify raised omegaconf's error
    missing = [
        s for s in RECORDED_SECTIONS if not isinstance(cfg, DictConfig) or not isinstance(cfg.get(s), DictConfig)
    ]
    if missing:
        raise TraceError(
            f"{path} is not a run's config: it has no {' or '.join(missing)} section (a run records its whole "
            f"config, the model and engine it ran among it): cannot rebuild the engine of this run"
        )
    return cfg


RECORDED_SECTIONS = ("model", "engine")  # the config.yaml sections a replay and a verify rebuild the run from


def _version(table: pa.Table) -> str:
    return (table.schema.metadata or {}).get(b"toolkit_schema_version", b"").decode()


def _check_version(table: pa.Table, what: str) -> None:
    version = _version(table)
    if version != str(SCHEMA_VERSION) and version not in {str(v) for v in COMPATIBLE}:
        raise TraceError(f"{what}: schema version {version or 'missing'!r}, this toolkit reads {SCHEMA_VERSION}")


def _add_missing(table: pa.Table, schema: pa.Schema, kind: str) -> pa.Table:
    """An older version's table gets the columns it did not have, as nulls (in the current order)."""
    missing = next((cols[kind] for v, cols in COMPATIBLE.items() if str(v) == _version(table)), ())
    if not missing or table.schema.names != [n for n in schema.names if n not in missing]:
        return table
    columns = {
        name: table.column(name) if name in table.schema.names else pa.nulls(table.num_rows, schema.field(name).type)
        for name in schema.names
    }
    return pa.table(columns, schema=schema.remove_metadata().with_metadata(table.schema.metadata))


def _check_types(table: pa.Table, schema: pa.Schema, where: Path) -> None:
    """A TraceError naming the first column whose type is not `schema`'s (a prompt of doubles read as token ids,
    or parts no table can join)."""
    retyped = next((f for f in schema if table.schema.field(f.name).type != f.type), None)
    if retyped is not None:
        found = table.schema.field(retyped.name).type
        raise TraceError(f"{where}: column {retyped.name} is {found}, expected {retyped.type}")


def _read_part(part: Path) -> pa.Table:
    """One Parquet file of a trace, or a TraceError: missing, not a file (pyarrow read a directory as an empty
    dataset, then said its schema version was missing), truncated or corrupt."""
    if part.exists() and not part.is_file():
        raise TraceError(f"{part} is not a file (each part of a trace is one Parquet file)")
    try:
        return pq.read_table(part)
    except FileNotFoundError:
        raise TraceError(f"{part} is missing") from None
    except (pa.ArrowException, OSError) as exc:
        raise TraceError(f"{part} is truncated or corrupt: {exc}") from None


def _joined(tables: list[pa.Table], where: Path) -> pa.Table:
    """The parts of one table, joined; a TraceError where they do not share one schema (a foreign part)."""
    try:
        return pa.concat_tables(tables)
    except pa.ArrowInvalid as exc:
        first = str(exc).splitlines()[0].rstrip(": ")
        raise TraceError(f"{where}: its parts do not share one schema ({first}): a part from elsewhere") from None


SAMPLE_KEY = ("request_id", "stream", "position")  # one row a sampled position of a sequence
REQUIRED = ("run_id", *SAMPLE_KEY, "token_id")  # columns no row may leave null (a converted transcript has no step)


def read_samples(run_dir: Path, check_version: bool = True) -> pa.Table:
    """Every SampleTrace row of the run, in the order written (parts in name order). Refused, naming the part: a
    column missing, renamed or of another type, a row of another run (its run_id not the manifest's, where one is
    readable), a key left null, and a sampled position given twice."""
    directory = Path(run_dir) / SAMPLES_DIR
    if not directory.is_dir():
        raise TraceError(f"{directory} is missing")
    run_id = _manifest_run_id(run_dir)
    tables = []
    for part in sorted(directory.glob("part-*.parquet")):
        table = _read_part(part)
        if check_version:
            _check_version(table, str(part))
        table = _add_missing(table, SAMPLES_SCHEMA, "samples")
        if table.schema.names != SAMPLES_SCHEMA.names:
            raise TraceError(f"{part} has columns {table.schema.names}, expected {SAMPLES_SCHEMA.names}")
        _check_types(table, SAMPLES_SCHEMA, part)
        null = next((name for name in REQUIRED if table.column(name).null_count), None)
        if null is not None:
            raise TraceError(f"{part}: {table.column(null).null_count} rows have no {null}")
        runs = pc.unique(table.column("run_id")).to_pylist()
        run_id = run_id if run_id is not None else runs[0] if runs else None
        if any(r != run_id for r in runs):
            other = next(r for r in runs if r != run_id)
            raise TraceError(
                f"{part} holds rows of run {other!r}, not of this run ({run_id!r}): a part from another run"
            )
        tables.append(table)
    if not tables:
        return SAMPLES_SCHEMA.empty_table()
    table = pa.concat_tables(tables)
    counts = table.group_by(list(SAMPLE_KEY)).aggregate([([], "count_all")])
    twice = counts.filter(pc.greater(counts.column("count_all"), 1))
    if twice.num_rows:
        first = twice.slice(0, 1).to_pylist()[0]
        raise TraceError(
            f"{directory}: {twice.num_rows} sampled positions have more than one row (the first: "
            f"{first['request_id']}#{first['stream']} at position {first['position']}, {first['count_all']} rows)"
        )
    return table


def _manifest_run_id(run_dir: Path) -> str | None:
    """The run id its manifest names, or None where there is no readable one (read_manifest says why, elsewhere)."""
    try:
        manifest = json.loads((Path(run_dir) / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    return manifest.get("run_id") if isinstance(manifest, dict) else None


def check_rows_present(requests: pa.Table, samples: pa.Table, run_dir: Path) -> None:
    """A TraceError where sample rows were lost or edited after the run: none at all while requests.parquet lists
    output tokens; another count than summary.json's `trace_rows` (the rows the writer put on disk); or a
    sequence requests.parquet records as ended whose rows do not spell its output tokens. Where the run did not
    close whole (kill -9 leaves no summary.json and its rows up to the last flush; Ctrl-C or a failure may leave
    a step's rows unwritten), an ended sequence's rows may stop short of its output, never disagree with it."""
    outputs = pc.sum(pc.list_value_length(requests.column("output_token_ids"))).as_py() or 0
    if samples.num_rows == 0 and outputs:
        raise TraceError(
            f"{Path(run_dir) / SAMPLES_DIR} holds no sample rows, yet requests.parquet lists {outputs} output tokens: "
            f"the trace's rows are lost"
        )
    summary = read_summary(run_dir)
    written = summary.get("trace_rows")
    counted = isinstance(written, int) and not isinstance(written, bool)
    # closed whole: every step's rows reached the writer. A run stopped by Ctrl-C or a failure closes with a
    # summary too, and its last step's rows may never have been handed over (nor a failed write's part).
    whole = counted and not summary.get("interrupted") and not summary.get("failed")
    if counted and written != samples.num_rows:
        raise TraceError(
            f"{Path(run_dir) / SAMPLES_DIR} holds {samples.num_rows} sample rows, but the run wrote {written} "
            f"(summary.json's trace_rows): rows were lost or added after the run"
        )
    spelled: dict[tuple[str, int], list[tuple[int, int, str | None]]] = {}
    for rid, stream, position, token, finish in zip(
        *(samples.column(c).to_pylist() for c in ("request_id", "stream", "position", "token_id", "finish_reason"))
    ):
        spelled.setdefault((rid, stream), []).append((position, token, finish))
    recorded = requests.select(["request_id", "stream", "output_token_ids", "finish_reason"]).to_pylist()
    known = {(row["request_id"], row["stream"]) for row in recorded}
    unknown = next((key for key in spelled if key not in known), None)
    if unknown is not None:  # a part of requests.parquet lost: a replay would call each of its sequences diverged
        raise TraceError(
            f"samples.parquet has rows for {unknown[0]}#{unknown[1]}, which requests.parquet lacks (a part of it lost?)"
        )
    for row in recorded:
        if row["finish_reason"] is None:
            continue
        rows = sorted(spelled.get((row["request_id"], row["stream"]), ()))
        want = row["output_token_ids"] or []
        got = [t for _, t, _ in rows if t is not None and t >= 0]  # an error row samples nothing
        name = f"{row['request_id']}#{row['stream']}"
        if got != want and (whole or got != want[: len(got)]):
            j = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise TraceError(
                f"{name}: requests.parquet records it ended ({row['finish_reason']}) with {len(want)} output tokens, "
                f"but its sample rows spell {len(got)}, the first apart at output token {j}: the trace was edited or "
                f"its rows lost"
            )
        ends = [(p, f) for p, _, f in rows if f is not None]
        if ends and (ends[0][1] != row["finish_reason"] or ends[0][0] != rows[-1][0]):
            raise TraceError(
                f"{name}: its sample row at position {ends[0][0]} says it finished ({ends[0][1]}), requests.parquet "
                f"that it ended ({row['finish_reason']}) at its last row, position {rows[-1][0]}: the trace was edited"
            )
    check_policy(requests, samples)


def require_rows(samples: pa.Table, run_dir: Path, what: str) -> None:
    """A TraceError where the trace holds no sample row at all (every request rejected, or a run killed before its
    first flush): a replay or a verify of it checked nothing, and said "bit-identical" or "verified" (exit 0)."""
    if samples.num_rows == 0:
        raise TraceError(
            f"{Path(run_dir) / SAMPLES_DIR} holds no sample rows: the run sampled no token that reached its trace "
            f"(every request rejected, or stopped before its first flush), so there is nothing to {what}"
        )


# the sampling policy each sample row records beside its request's (requests.parquet's sampling_params)
POLICY_FIELDS = ("temperature", "top_p", "top_k", "min_p")


def check_policy(requests: pa.Table, samples: pa.Table) -> None:
    """A TraceError where a sequence's first sample row records another sampling policy (temperature, top_p,
    top_k, min_p, seed) than its request row: one of the two files was edited (a replay re-adds the request's, a
    verify recomputes with it). A converted transcript's rows (mode=audit) record the other engine's claims: not
    checked."""
    columns = ("request_id", "stream", *POLICY_FIELDS, "seed")
    keyed = samples.select(["request_id", "stream"]).append_column("row", pa.array(range(samples.num_rows), pa.int64()))
    firsts = keyed.group_by(["request_id", "stream"]).aggregate([("row", "min")]).column("row_min")
    heads = samples.select(list(columns)).take(firsts)  # a sequence's first row each, found in Arrow (millions of rows)
    first = {
        (rid, stream): tuple(values) for rid, stream, *values in zip(*(heads.column(c).to_pylist() for c in columns))
    }
    for row in requests.select(["request_id", "stream", "sampling_params", "seed", "origin_engine"]).to_pylist():
        recorded = first.get((row["request_id"], row["stream"]))
        if recorded is None or row["origin_engine"] is not None:
            continue
        try:
            params = json.loads(row["sampling_params"])
        except (TypeError, ValueError, RecursionError):
            params = None  # replay and verify name corrupt sampling_params (recorded_sampling)
        wanted = {**(params if isinstance(params, dict) else {}), "seed": row["seed"]}
        for name, value in zip((*POLICY_FIELDS, "seed"), recorded):
            want = wanted.get(name)
            if value is None or not is_number(want) or _stored(name, want) == value:
                continue
            raise TraceError(
                f"{row['request_id']}#{row['stream']}: its sample rows record {name} {value!r}, requests.parquet "
                f"{'its seed' if name == 'seed' else 'its sampling_params'} {name} {want!r}: the trace was edited"
            )


def _stored(name: str, value: float) -> float | int:
    """A policy value as its sample column stores it (temperature, top_p, min_p: float32)."""
    if name in ("temperature", "top_p", "min_p"):
        try:
            return struct.unpack("<f", struct.pack("<f", value))[0]
        except (OverflowError, struct.error):
            return value
    return value


def read_summary(run_dir: Path) -> dict[str, Any]:
    """summary.json (written when a run closes), or {} where there is none (a run killed before it closed). One
    that is there but unreadable, no JSON object, or with a field a reader uses of another type (SUMMARY_FIELDS) is a
    TraceError: summaries are written whole (atomically), so it was damaged or edited, and reading it as a killed
    run's would switch off the checks of a closed run's rows."""
    path = Path(run_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as exc:
        raise TraceError(f"{path} is unreadable or corrupt: {exc}") from None
    if not isinstance(summary, dict):
        raise TraceError(f"{path} is corrupt: a JSON {type(summary).__name__}, not an object")
    _check_fields(summary, SUMMARY_FIELDS, path)
    return summary


# what each summary.json field a reader uses must be, where it is not null: compare's table (counts and figures, the
# run_id of a run without request rows), the closed-run checks (trace_rows, interrupted, failed) and the report's
# notes and cards. A figure of another type reached pyarrow and str.format as a traceback after part of compare's
# output was written; a trace_rows of another type switched the closed-run checks off. NaN and Infinity (Python's
# json writes them) are numbers, shown as missing; other keys (a newer writer's, a run's extras) are kept as written.
SUMMARY_FIGURES = (  # compare's columns after requests and output_tokens
    "output_tok_per_s",
    "ttft_p50_s",
    "ttft_p95_s",
    "tpot_p50_s",
    "tpot_p95_s",
    "acceptance_rate",
    "json_validity_rate",
)
SUMMARY_FIELDS = {
    **dict.fromkeys(("requests", "output_tokens", "trace_rows", "num_preemptions", "steps", "rejected"), "a count"),
    **dict.fromkeys(SUMMARY_FIGURES, "a number"),
    **dict.fromkeys(("run_id", "signal", "failed"), "a string"),
    "interrupted": "true or false",
    "rejected_requests": "a list of strings",
}


def _is_kind(value: Any, kind: str) -> bool:
    if kind == "a count":  # a count as requests.parquet and compare.parquet store it (int64)
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63
    if kind == "a number":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        try:
            float(value)  # an integer past a double's range is none
        except OverflowError:
            return False
        return True
    if kind == "a string":
        return isinstance(value, str)
    if kind == "true or false":
        return isinstance(value, bool)
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def read_requests(run_dir: Path, check_version: bool = True) -> pa.Table:
    """One row per sequence. requests.parquet is a directory of append-only parts (final rows, in the order
    requests ended) beside requests.open.parquet (those not ended when it was written, e.g. before a kill -9):
    both are read, a request's final row wins, and rows come back in arrival order. A run recorded before
    2026-11-28 outside a server has one requests.parquet file instead, read as it is."""
    path = Path(run_dir) / REQUESTS_FILE
    if not path.is_dir():
        return _read_requests_table(path, check_version)
    ended = [_read_requests_table(part, check_version) for part in sorted(path.glob("part-*.parquet"))]
    table = pa.concat_tables(ended) if ended else REQUESTS_SCHEMA.empty_table()
    open_path = Path(run_dir) / OPEN_REQUESTS_FILE
    if open_path.exists():
        still_open = _read_requests_table(open_path, check_version)
        done = set(zip(table.column("request_id").to_pylist(), table.column("stream").to_pylist()))
        keep = [
            (r, s) not in done
            for r, s in zip(still_open.column("request_id").to_pylist(), still_open.column("stream").to_pylist())
        ]
        table = pa.concat_tables([table, still_open.filter(pa.array(keep, pa.bool_()))])
    if table.column("arrival_index").null_count:  # rows without a recorded arrival (a converted transcript): as written
        return table
    return table.sort_by([("arrival_index", "ascending"), ("stream", "ascending")])


def _read_requests_table(path: Path, check_version: bool) -> pa.Table:
    table = _read_part(path)
    if check_version:
        _check_version(table, str(path))
    table = _add_missing(table, REQUESTS_SCHEMA, "requests")
    if table.schema.names != REQUESTS_SCHEMA.names:
        raise TraceError(f"{path} has columns {table.schema.names}, expected {REQUESTS_SCHEMA.names}")
    _check_types(table, REQUESTS_SCHEMA, path)
    return table


def read_rejected(run_dir: Path) -> pa.Table:
    """A served run's refused (503) and failed (500) requests, in the order recorded (none: an empty table)."""
    tables = [_read_part(part) for part in sorted((Path(run_dir) / REJECTED_DIR).glob("part-*.parquet"))]
    return _joined(tables, Path(run_dir) / REJECTED_DIR) if tables else REJECTED_SCHEMA.empty_table()


def read_steps(run_dir: Path) -> pa.Table | None:
    """The run's step records (steps.parquet: parts in name order, or one file in a run recorded before
    2026-11-28); None when it recorded none (an audit of a transcript, a run that never stepped)."""
    path = Path(run_dir) / STEPS_DIR
    parts = sorted(path.glob("part-*.parquet")) if path.is_dir() else [path] if path.exists() else []
    tables = [_read_part(part) for part in parts]
    return _joined(tables, path) if tables else None
