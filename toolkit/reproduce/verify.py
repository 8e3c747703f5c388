"""Verify: teacher-forced recomputation of a recorded run.

For every sequence, prompt + the tokens its trace rows record are run through a full
no-cache forward (our float64 textbook reference by default, or HF transformers'
forward with `reference="hf"`); the recomputed raw log-probability of every recorded
token is compared with the recorded one, and every greedy row's token must still be the
argmax of the processed logits (the processors are re-applied to the recomputed logits).
For a trace recorded with `engine.batch_invariant=true`, `reference="exact"` recomputes
with the engine's own batch-invariant forward (fresh cache, one prefill) and demands the
recorded bits: every row's sha256 of the raw fp32 logits must equal the recorded digest
and its raw log-probability must be the same float (cached == recomputed, exactly).
The textbook reference runs the recorded run's weights (in the run's format, bf16 / fp16 included) with
float64 arithmetic by default, or fp32 (`reference_dtype`), so a 16-bit run's error is reported against
either; `atol="auto"` is the run format's tolerance (AUTO_ATOL: about 2.5x the largest error measured on
SmolLM2 chat runs, docs/precision.md).
A hand-edited token fails at its own row: its recorded log-probability no longer matches,
and the rows after it are reported as depending on it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from omegaconf import OmegaConf

from toolkit.config import EngineConfig, ModelConfig, from_mapping, is_number
from toolkit.engine.runner import recompute_logits
from toolkit.errors import ConfigError
from toolkit.models import load_model
from toolkit.models.loading import hf_reference_model, load_checkpoint
from toolkit.models.reference import reference_logits
from toolkit.native import invariant_gpu
from toolkit.native.library import available as kernels_available
from toolkit.reproduce.replay import recorded_sampling
from toolkit.reproduce.shard import RayOptions, progress_bar, run_on_ray
from toolkit.sampling import rng
from toolkit.sampling.grammar import LazyGrammar
from toolkit.sampling.processors import BatchView, RowState, apply_pipeline
from toolkit.sampling.processors.masks import resolve_bad_words
from toolkit.sampling.sampler import logsumexp_rows
from toolkit.trace.reader import (
    TraceError,
    check_rows_present,
    read_config,
    read_manifest,
    read_requests,
    read_samples,
    require_rows,
)
from toolkit.trace.writer import atomic_write_table, logits_digest


@dataclass(frozen=True)
class RowCheck:
    request_id: str
    stream: int
    position: int
    token_id: int
    recorded_logprob: float | None  # None: no claim (an audited transcript's missing or processed logprob)
    recomputed_logprob: float
    abs_diff: float
    greedy: bool
    argmax_ok: bool | None  # greedy rows: is the token still the processed argmax?
    failed: bool
    reason: str


# verify's default tolerance per recorded format: fp32's rounding, and about 2.5x the largest |raw logprob
# diff| measured against the float64 reference on 16 SmolLM2 chat requests of up to 128 tokens (AMD EPYC, AVX2:
# bf16 0.195 over 1,095 rows, fp16 0.018 over 1,104)
AUTO_ATOL = {"float32": 1e-4, "bfloat16": 0.5, "float16": 0.05}
REFERENCE_DTYPES = {"float64": torch.float64, "float32": torch.float32}


@dataclass
class VerifyReport:
    trace_dir: Path
    reference: str
    atol: float
    run_dtype: str = "float32"
    reference_dtype: str = "float64"
    kv_cache_dtype: str = "auto"  # the run's KV storage (manifest): 8 / 16 bits differ from the reference by design
    rows_checked: int = 0
    sequences_checked: int = 0
    max_abs_diff: float = 0.0
    max_at: str | None = None
    greedy_rows: int = 0
    greedy_argmax_mismatches: int = 0
    near_tie_flips: int = 0  # greedy argmax flipped, but within atol of the top: reported, not failed
    failures: list[RowCheck] = field(default_factory=list)  # first failing row of each sequence
    downstream_rows: int = 0  # failing rows after a sequence's first failure (their prefix holds it)
    error_rows: int = 0  # rows that sampled nothing (an error ended their sequence): nothing to recompute
    unclaimed_rows: int = 0  # rows recording no raw logprob (an audit's transcript): their token checked alone
    checks: list[RowCheck] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def summary_line(self) -> str:
        head = "verified" if self.passed else "FAILED"
        arithmetic = f" in {self.reference_dtype}" if self.reference == "ours" else ""
        line = (
            f"{head}: {self.rows_checked} rows of {self.sequences_checked} sequences ({self.run_dtype} run) "
            f"recomputed with the {self.reference} reference{arithmetic}; max |raw logprob diff| "
            f"{self.max_abs_diff:.3g}"
            f"{' at ' + self.max_at if self.max_at else ''} (atol {self.atol:g}); greedy rows still argmax: "
            f"{self.greedy_rows - self.greedy_argmax_mismatches}/{self.greedy_rows}"
        )
        if self.near_tie_flips:
            line += f" ({self.near_tie_flips} near-tie flips within atol)"
        if self.error_rows:
            line += f"; {self.error_rows} error rows sampled nothing and are not recomputed"
        if self.unclaimed_rows:
            line += (
                f"; {self.unclaimed_rows} rows record no raw logprob (an audited transcript's): tokens checked alone"
            )
        if not self.passed and self.kv_cache_dtype not in ("auto", None):
            line += (
                f"; this run's KV cache is {self.kv_cache_dtype}, and the reference keeps K and V in full precision: "
                f"the difference is the quantisation's (docs/kv-cache.md measures it), bound it with verify.atol"
            )
        return line

    def to_dict(self) -> dict[str, Any]:
        return {
            "trace_dir": str(self.trace_dir),
            "reference": self.reference,
            "atol": self.atol,
            "run_dtype": self.run_dtype,
            "reference_dtype": self.reference_dtype,
            "kv_cache_dtype": self.kv_cache_dtype,
            "passed": self.passed,
            "rows_checked": self.rows_checked,
            "sequences_checked": self.sequences_checked,
            "max_abs_diff": self.max_abs_diff,
            "max_at": self.max_at,
            "greedy_rows": self.greedy_rows,
            "greedy_argmax_mismatches": self.greedy_argmax_mismatches,
            "near_tie_flips": self.near_tie_flips,
            "downstream_rows": self.downstream_rows,
            "error_rows": self.error_rows,
            "unclaimed_rows": self.unclaimed_rows,
            "failures": [f"{c.request_id}#{c.stream} position {c.position}: {c.reason}" for c in self.failures],
        }


def _hf_forward(model_cfg: ModelConfig):
    """HF transformers' implementation of the model's family on the same weights, as a function ids -> logits (T, V)."""
    model = hf_reference_model(load_checkpoint(model_cfg))

    @torch.inference_mode()
    def forward(ids: list[int]) -> torch.Tensor:
        return model(torch.tensor([ids])).logits[0].double()

    return forward


def reference_forward(loaded, reference: str, dtype: torch.dtype = torch.float64):
    """ids -> logits (T, V): our textbook forward ("ours") on the loaded weights with `dtype` arithmetic, or HF
    transformers' forward of the same family on the checkpoint's fp32 weights ("hf")."""
    if reference == "hf":
        return _hf_forward(loaded.config)
    return lambda ids: reference_logits(loaded.model, ids, dtype)


REFERENCES = ("ours", "hf", "exact")


def check_reference(reference: Any, atol: Any, section: str = "verify") -> None:
    """<section>.reference and <section>.atol checked: one ConfigError naming the option (mode=verify, and
    mode=kv_quantization before any variant runs)."""
    if reference not in REFERENCES:
        raise ConfigError(f"{section}.reference must be 'ours', 'hf' or 'exact', got {reference!r}")
    if atol != "auto" and not (is_number(atol) and 0 < atol < math.inf):
        raise ConfigError(f"{section}.atol must be a positive number or auto, got {atol!r}")


def verify(
    run_dir: str | Path,
    *,
    reference: str = "ours",
    atol: float | str = "auto",
    reference_dtype: str = "float64",
    out_dir: str | Path | None = None,
    ray: RayOptions | None = None,
) -> VerifyReport:
    """The trace's every sampled row recomputed teacher-forced and compared (on Ray workers when `ray` is given:
    toolkit.reproduce.shard, the same report)."""
    run_dir = Path(run_dir)
    check_reference(reference, atol)
    if reference_dtype not in REFERENCE_DTYPES:
        raise ConfigError(f"verify.reference_dtype must be float64 or float32, got {reference_dtype!r}")
    manifest = read_manifest(run_dir)
    run_dtype = manifest.get("dtype", "float32")
    if atol == "auto":
        atol = AUTO_ATOL.get(run_dtype, AUTO_ATOL["float32"])
    cfg = read_config(run_dir)
    model_cfg = from_mapping(ModelConfig, OmegaConf.to_container(cfg.model, resolve=True), section="model")
    engine_cfg = from_mapping(EngineConfig, OmegaConf.to_container(cfg.engine, resolve=True), section="engine")
    loaded = load_model(model_cfg, engine_cfg.device)
    if loaded.revision != manifest.get("weights_sha256"):
        raise TraceError("refusing to verify: the model weights differ from the recorded run's")
    rebuilt = str(loaded.model.embed.dtype).removeprefix("torch.")
    if rebuilt != run_dtype:  # the tolerance follows the run's format: the manifest's word alone is not taken
        raise TraceError(f"refusing to verify: manifest.json says a {run_dtype} run, its config.yaml loads {rebuilt}")
    if reference == "exact" and not manifest.get("batch_invariant", False):
        raise ConfigError(
            "verify.reference=exact needs a trace recorded with engine.batch_invariant=true "
            "(other runs' bits depend on their batches; use reference=ours)"
        )
    on_gpu = torch.device(engine_cfg.device).type == "cuda"
    if reference == "exact" and not (invariant_gpu.triton is not None if on_gpu else kernels_available()):
        raise ConfigError(
            f"verify.reference=exact needs the {'Triton' if on_gpu else 'native'} kernels (the "
            f"batch-invariant bits), which do not run here; use reference=ours"
        )
    requests_table, samples_table = read_requests(run_dir), read_samples(run_dir)
    check_rows_present(requests_table, samples_table, run_dir)
    require_rows(samples_table, run_dir, "verify")
    requests = {(r["request_id"], r["stream"]): r for r in requests_table.to_pylist()}
    samples = samples_table.to_pylist()
    report = VerifyReport(
        trace_dir=run_dir,
        reference=reference,
        atol=float(atol),
        run_dtype=run_dtype,
        reference_dtype=reference_dtype,
        kv_cache_dtype=manifest.get("kv_cache_dtype", "auto"),
    )

    by_seq: dict[tuple[str, int], list[dict]] = {}
    for row in samples:
        by_seq.setdefault((row["request_id"], row["stream"]), []).append(row)
    jobs = []
    for key, rows in by_seq.items():  # (each has its request: check_rows_present)
        rows.sort(key=lambda r: r["position"])
        jobs.append((key, rows, requests[key]))
    if ray is not None:  # each sequence on its own in a Ray worker; the parts joined in this order
        weights = [len(rows) + len(request["prompt_token_ids"]) for _, rows, request in jobs]
        empty = dataclasses.replace(report, failures=[], checks=[])
        parts = run_on_ray(
            OmegaConf.to_container(cfg.model, resolve=True),
            ray,
            weights,
            "verify",
            _verify_shard,
            lambda shard: ([jobs[i] for i in shard], empty),
        )
        for k in sorted(parts):
            absorb(report, parts[k])
    else:
        with progress_bar(sum(len(r) + len(q["prompt_token_ids"]) for _, r, q in jobs), "verify") as bar:
            verify_sequences(jobs, loaded, report, progress=bar.update)
    report.sequences_checked = len(by_seq)
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "verify.json").write_text(json.dumps(report.to_dict(), indent=2))
        atomic_write_table(
            out_dir / "verify.parquet",
            pa.Table.from_pylist([c.__dict__ for c in report.checks])
            if report.checks
            else pa.table({"request_id": pa.array([], pa.string())}),
        )
    return report


def verify_sequences(
    jobs: list[tuple[tuple[str, int], list[dict], dict]],
    loaded,
    report: VerifyReport,
    progress: Callable[[int], Any] | None = None,
) -> VerifyReport:
    """Each (key, sample rows, request row) recomputed on its own with the report's reference, into `report`."""
    if report.reference == "exact":
        forward = lambda ids: recompute_logits(loaded.model, ids)  # noqa: E731
    else:
        forward = reference_forward(loaded, report.reference, REFERENCE_DTYPES[report.reference_dtype])
    eos = tuple(
        sorted(
            set(loaded.arch.eos_token_ids)
            | (
                {loaded.tokenizer.eos_token_id}
                if loaded.tokenizer and loaded.tokenizer.eos_token_id is not None
                else set()
            )
        )
    )
    vocab = loaded.arch.vocab_size
    grammar = LazyGrammar(loaded.tokenizer, vocab, tuple(t for t in eos if t < vocab) or (0,))  # the engine's
    for key, rows, request in jobs:
        _verify_sequence(key, rows, request, forward, loaded, eos, grammar, report)
        if progress is not None:
            progress(len(rows) + len(request["prompt_token_ids"]))
    return report


def _verify_shard(loaded, memo: dict, jobs: list, empty: VerifyReport) -> VerifyReport:
    """A Ray worker's part of a verify (toolkit.reproduce.shard.run_on_ray): its sequences into an empty report."""
    return verify_sequences(jobs, loaded, empty)


COUNTS = (
    "rows_checked",
    "greedy_rows",
    "greedy_argmax_mismatches",
    "near_tie_flips",
    "downstream_rows",
    "error_rows",
    "unclaimed_rows",
)


def absorb(report: VerifyReport, part: VerifyReport) -> None:
    """A later shard's report joined to the earlier ones': what one pass over both in order would give."""
    for name in COUNTS:
        setattr(report, name, getattr(report, name) + getattr(part, name))
    if _larger(part.max_abs_diff, report.max_abs_diff):
        report.max_abs_diff, report.max_at = part.max_abs_diff, part.max_at
    report.failures += part.failures
    report.checks += part.checks


def _grammar_masks(grammar: LazyGrammar, spec, outputs: list[int], vocab: int) -> tuple[torch.Tensor, int | None]:
    """(len(outputs), vocab) bool: what the request's grammar allowed before each recorded output token, the
    engine's masks rebuilt by a fresh matcher fed the tokens in order; and the index of the first token it
    refused (None: all taken). Rows past a refused token allow everything: nothing constrains them any more."""
    backend = grammar()
    matcher = backend.matcher(spec)
    masks_RV = torch.ones(len(outputs), vocab, dtype=torch.bool)
    for i, token in enumerate(outputs):
        masks_RV[i] = backend.fill_masks([matcher])[0]
        if not backend.accept(matcher, token):
            return masks_RV, i
    return masks_RV, None


def _verify_sequence(key, rows, request, forward, loaded, eos, grammar, report: VerifyReport) -> None:
    request_id, stream = key
    prompt = list(request["prompt_token_ids"])
    params = recorded_sampling(request)
    sampled = [r for r in rows if r["token_id"] >= 0]  # an error row sampled nothing
    report.error_rows += len(rows) - len(sampled)
    rows = sampled
    if not rows:
        return
    tokens = prompt + [r["token_id"] for r in rows]
    vocab = loaded.arch.vocab_size
    outside = next((t for t in tokens if not 0 <= t < vocab), None)
    if outside is not None:
        raise TraceError(f"{request_id}#{stream}: token id {outside} is outside the model's vocabulary ({vocab})")
    expected_positions = list(range(len(prompt), len(tokens)))
    if [r["position"] for r in rows] != expected_positions:
        raise TraceError(f"{request_id}#{stream}: trace positions are not contiguous after the prompt")
    logits = forward(tokens[:-1])  # row t predicts token t + 1
    exact = report.reference == "exact"
    if exact:  # the engine's own arithmetic: logit - logsumexp in fp32
        logprobs = logits - logsumexp_rows(logits)[:, None]
    else:
        logprobs = torch.log_softmax(logits.double(), dim=-1)
    greedy = params.temperature == 0.0
    masks_RV, refused = None, None
    if params.structured_outputs is not None:
        masks_RV, refused = _grammar_masks(grammar, params.structured_outputs, [r["token_id"] for r in rows], vocab)
    if greedy:
        view = BatchView(
            tuple(
                RowState(params, tokens[:p], len(prompt), resolve_bad_words(params.bad_words, loaded.tokenizer))
                for p in expected_positions
            ),
            loaded.arch.vocab_size,
            logits.device,
            eos,
            None if masks_RV is None else masks_RV.to(logits.device),
        )
        processed = apply_pipeline(logits[len(prompt) - 1 :].float(), view).processed_RV
    failed_before = False
    for i, row in enumerate(rows):
        p = row["position"]
        recomputed = float(logprobs[p - 1, row["token_id"]])
        claimed = row["raw_logprob"]  # None in an audit's converted transcript without the model's logprob
        diff = 0.0 if claimed is None else abs(recomputed - claimed)
        report.unclaimed_rows += claimed is None
        argmax_ok = None
        reason = ""
        if greedy:
            report.greedy_rows += 1
            top = int(torch.argmax(processed[i]))
            argmax_ok = top == row["token_id"]
            if not argmax_ok:
                report.greedy_argmax_mismatches += 1
                margin = float(processed[i, top] - processed[i, row["token_id"]])
                if margin <= report.atol and diff <= report.atol:
                    report.near_tie_flips += 1
                else:
                    reason = f"greedy token {row['token_id']} is not the argmax ({top}, margin {margin:.3g})"
        if i == refused:
            reason = f"the request's grammar does not allow token {row['token_id']} here"
        elif masks_RV is not None and row["grammar_allowed"] not in (None, int(masks_RV[i].sum())):
            reason = (
                f"the grammar allows {int(masks_RV[i].sum())} tokens here, the trace records {row['grammar_allowed']}"
            )
        noise = row["noise"]
        if not greedy and row["origin"] in (None, "plain") and noise is not None and math.isfinite(noise):
            # a sampled token's noise is its request key's (seed, position, stream) for that token: a token or a
            # noise edited alone is named here, where its logprob may lie within atol (replay proves the choice)
            want = rng.gumbel_scalar(rng.row_key(request["seed"], p, stream), row["token_id"])
            if want != noise:
                reason = (
                    f"noise {noise!r} is not the request key's for token {row['token_id']} ({want!r}): the token "
                    f"or its noise was edited"
                )
        if diff > report.atol or not math.isfinite(diff):
            reason = (
                f"raw logprob recorded {claimed:.6g}, recomputed {recomputed:.6g} "
                f"(|diff| {diff:.3g} > atol {report.atol:g})"
            )
        if exact and not reason:
            if diff != 0.0:
                reason = f"raw logprob bits differ: recorded {row['raw_logprob']!r}, recomputed {recomputed!r}"
            elif logits_digest(logits[p - 1]) != row["logits_sha256"]:
                reason = "logits sha256 differs from the recorded digest: cached != recomputed bits"
        if _larger(diff, report.max_abs_diff):
            report.max_abs_diff, report.max_at = diff, f"{request_id}#{stream} position {p}"
        check = RowCheck(
            request_id,
            stream,
            p,
            row["token_id"],
            row["raw_logprob"],
            recomputed,
            diff,
            greedy,
            argmax_ok,
            bool(reason),
            reason,
        )
        report.checks.append(check)
        report.rows_checked += 1
        if reason:
            if failed_before:
                report.downstream_rows += 1
            else:
                report.failures.append(check)
                failed_before = True


def _larger(diff: float, largest: float) -> bool:
    """Whether `diff` is the new largest: a NaN (a recorded logprob of NaN) is, once, and stays (it was shown as 0)."""
    return diff > largest or (math.isnan(diff) and not math.isnan(largest))
