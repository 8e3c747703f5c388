"""Audit: did the engine that wrote a transcript compute the probabilities it claims?

`python run.py mode=audit audit.input=<file> audit.format=<openai|token_ids|hf> audit.reference=<ours|hf>`
reads another engine's tokens and logprobs (toolkit.audit.transcripts), converts them into our
trace (requests.parquet with `origin_engine` and the source line, samples.parquet with the claimed
logprobs and top alternatives), recomputes every token teacher-forced with the reference (our float64
forward and/or HF transformers on the same weights) and reports, per request and overall:

- claimed vs recomputed logprob of every token: max / p50 / p99 absolute error;
- KL(claimed || reference) where top-logprobs allow it: over the claimed top ids plus one bucket
  for the rest of the vocabulary (a lower bound of the full KL);
- top-logprobs that cannot be a distribution (mass above 1) and top alternatives off by more than atol;
- tokens the claimed policy could not have produced: outside the top-k / top-p / min-p support its
  stated sampling parameters give under the reference (beyond atol of the support's edge);
- for greedy requests (temperature 0), the first position whose token is not the reference's argmax
  (beyond atol: near ties are not departures);
- the per-token importance ratio exp(reference - claimed) RL users correct with: mean, max, the share
  outside [0.5, 2] and the sequence-level product.

Exit code 0 when every token is within `audit.atol` and nothing is flagged, 1 when anything is
flagged (a bad line included: the other lines are still audited), 2 when the input is unusable.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import torch
from omegaconf import DictConfig, OmegaConf

from toolkit.audit.detector import (DEFAULT_SCALES, RECOMPUTATION, WINDOWS, Detection, auc, calibrate_scales, combined,
                                    detect, residuals_of, window_scores)
from toolkit.audit.detector import FORMATS as DETECTOR_FORMATS
from toolkit.audit.shard import in_order, launcher, progress_bar, ray_options, run_on_ray
from toolkit.audit.transcripts import FORMATS, LineError, Transcript, TranscriptError, read_transcripts
from toolkit.audit.verify import reference_forward
from toolkit.config import ModelConfig, SamplingParams, from_mapping
from toolkit.errors import ConfigError, ForeignEngineError, ToolkitError
from toolkit.metrics import percentile

REFERENCES = ("ours", "hf")
RATIO_BAND = (0.5, 2.0)


class AuditInputError(ToolkitError):
    """The transcript cannot be audited at all (exit code 2)."""

    exit_code = 2


@dataclass
class TokenCheck:
    request_id: str
    stream: int
    position: int
    token_id: int
    claimed: float | None
    recomputed: float
    abs_error: float | None
    ratio: float | None  # exp(recomputed - claimed)
    kl: float | None  # KL(claimed || reference) over the claimed top ids + the rest
    top_max_abs_error: float | None
    reference_argmax: int
    kinds: list[str] = field(default_factory=list)
    why: list[str] = field(default_factory=list)


@dataclass
class RequestReport:
    request_id: str
    stream: int
    line: int
    origin_engine: str
    tokens: int = 0  # output tokens with a claimed logprob
    output_tokens: int = 0
    checks: list[TokenCheck] = field(default_factory=list)
    problems: list[dict] = field(default_factory=list)  # from reading the line: missing logprob, unmapped token
    first_greedy_departure: int | None = None
    first_departure_margin: float | None = None  # the reference's logprob margin of its argmax there
    prompt_source: str = "given"  # given | encoded | rebuilt (toolkit.audit.transcripts.Transcript)
    sampling_assumed: dict[str, Any] = field(default_factory=dict)  # policy fields not stated: the values taken

    def flagged(self) -> list[dict]:
        out = [{"position": c.position, "token_id": c.token_id, "claimed": c.claimed, "recomputed": c.recomputed,
                "kind": ",".join(c.kinds), "why": "; ".join(c.why)} for c in self.checks if c.kinds]
        out += [dict(p) for p in self.problems]
        return sorted(out, key=lambda f: f["position"])

    def to_dict(self) -> dict[str, Any]:
        errors = [c.abs_error for c in self.checks if c.abs_error is not None]
        ratios = [c.ratio for c in self.checks if c.ratio is not None]
        kls = [c.kl for c in self.checks if c.kl is not None]
        flagged = self.flagged()
        log_product = sum(math.log(r) for r in ratios if r > 0) if ratios and all(r > 0 for r in ratios) else None
        return {"request_id": self.request_id, "stream": self.stream, "line": self.line,
                "origin_engine": self.origin_engine, "prompt": self.prompt_source,
                "sampling_assumed": self.sampling_assumed, "tokens": self.tokens,
                "output_tokens": self.output_tokens,
                **_error_stats(errors), **_ratio_stats(ratios),
                "sequence_log_ratio": log_product,
                "sequence_ratio": _safe_exp(log_product),
                "kl_mean": sum(kls) / len(kls) if kls else None, "kl_max": max(kls) if kls else None,
                "first_greedy_departure": self.first_greedy_departure,
                "first_departure_margin": self.first_departure_margin,
                "first_flagged_position": flagged[0]["position"] if flagged else None,
                "flagged": flagged}


@dataclass
class AuditReport:
    source: str
    fmt: str
    reference: str
    atol: float
    requests: list[RequestReport] = field(default_factory=list)
    line_errors: list[LineError] = field(default_factory=list)
    sampling_defaults: str = "library defaults"  # where the policy fields requests leave out were taken from

    @property
    def checks(self) -> list[TokenCheck]:
        return [c for r in self.requests for c in r.checks]

    @property
    def flagged_tokens(self) -> int:
        return sum(len(r.flagged()) for r in self.requests)

    @property
    def passed(self) -> bool:
        return not self.flagged_tokens and not self.line_errors

    def to_dict(self) -> dict[str, Any]:
        checks = self.checks
        errors = [c.abs_error for c in checks if c.abs_error is not None]
        ratios = [c.ratio for c in checks if c.ratio is not None]
        kls = [c.kl for c in checks if c.kl is not None]
        per_request = [r.to_dict() for r in self.requests]
        seq = [r["sequence_ratio"] for r in per_request if r["sequence_ratio"] is not None]
        engines = sorted({r.origin_engine for r in self.requests})
        return {"source": self.source, "format": self.fmt, "origin_engines": engines, "reference": self.reference,
                "atol": self.atol, "sampling_defaults": self.sampling_defaults, "passed": self.passed,
                "tokens": len(errors), "flagged_tokens": self.flagged_tokens,
                **_error_stats(errors), **_ratio_stats(ratios),
                "kl_mean": sum(kls) / len(kls) if kls else None, "kl_max": max(kls) if kls else None,
                "kl_tokens": len(kls),
                "sequence_ratio_min": min(seq) if seq else None, "sequence_ratio_max": max(seq) if seq else None,
                "greedy_departures": sum(r.first_greedy_departure is not None for r in self.requests),
                "requests_flagged": sum(bool(r["flagged"]) for r in per_request),
                "lines_rejected": len(self.line_errors),
                "line_errors": [{"line": e.line, "request_id": e.request_id, "why": e.why} for e in self.line_errors],
                "requests": per_request}


def _safe_exp(x: float | None) -> float | None:
    if x is None:
        return None
    return math.exp(x) if x < 700 else math.inf


def _error_stats(errors: list[float]) -> dict[str, float | None]:
    if not errors:
        return {"max_abs_error": None, "p50_abs_error": None, "p99_abs_error": None, "mean_abs_error": None}
    return {"max_abs_error": max(errors), "p50_abs_error": percentile(errors, 50),
            "p99_abs_error": percentile(errors, 99), "mean_abs_error": sum(errors) / len(errors)}


def _ratio_stats(ratios: list[float]) -> dict[str, float | None]:
    if not ratios:
        return {"ratio_mean": None, "ratio_min": None, "ratio_max": None, "ratio_outside_share": None}
    lo, hi = RATIO_BAND
    return {"ratio_mean": sum(ratios) / len(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "ratio_outside_share": sum(not lo <= r <= hi for r in ratios) / len(ratios)}


# ------------------------------------------------------------------------------------------- the checks

Forward = Callable[[list[int]], torch.Tensor]  # token ids -> float64 logits (T, V), row t predicts token t + 1


def audit_transcripts(records: list[Transcript], forward: Forward, loaded, *, atol: float, reference: str,
                      source: str = "", fmt: str = "", line_errors: list[LineError] | None = None,
                      progress: Callable[[int], Any] | None = None) -> AuditReport:
    """Each record recomputed on its own (so its values never depend on the others: toolkit.audit.shard);
    `progress` is told each record's tokens as it is done."""
    report = AuditReport(source=source, fmt=fmt, reference=reference, atol=atol, line_errors=list(line_errors or []))
    eos = tuple(sorted(set(loaded.arch.eos_token_ids)))
    many = getattr(forward, "many", None)  # a reference that packs several records in one forward
    for group in _groups(records, getattr(forward, "max_tokens", 0) if many else 0):
        todo = [r for r in group if r.prompt_token_ids and r.output_token_ids]
        packed = dict(zip(map(id, todo), many([(r.prompt_token_ids + r.output_token_ids)[:-1] for r in todo],
                                              [len(r.output_token_ids) for r in todo]))) if many and todo else {}
        for record in group:
            report.requests.append(_audit_one(record, forward, loaded, atol, eos, packed.get(id(record))))
            if progress is not None:
                progress(_size(record))
    return report


def _audit_shard(loaded, memo: dict[str, Forward], records: list[Transcript], references: list[str],
                 atol: float) -> list[list[RequestReport]]:
    """A Ray worker's part of an audit (toolkit.audit.shard.run_on_ray): per reference, its records' reports."""
    return [audit_transcripts(records, _forward(loaded, r, memo), loaded, atol=atol, reference=r).requests
            for r in references]


def _size(record: Transcript) -> int:
    """The tokens a record's recomputation reads: its shard weight, its share of a packed forward, its progress."""
    return len(record.prompt_token_ids) + len(record.output_token_ids)


def _groups(records: list[Transcript], max_rows: int) -> list[list[Transcript]]:
    """Consecutive records of up to max_rows output tokens together (each alone when max_rows is 0): the
    logits rows one `many` call holds (it packs them into forwards by the tokens it computes)."""
    groups: list[list[Transcript]] = []
    size = 0
    for r in records:
        n = len(r.output_token_ids)
        if not groups or not max_rows or size + n > max_rows:
            groups.append([])
            size = 0
        groups[-1].append(r)
        size += n
    return groups


ASSUMED_FIELDS = ("temperature", "top_p", "top_k", "min_p")  # what the support and greedy checks read


def sampling_defaults(a: dict, loaded) -> tuple[str, dict[str, Any]]:
    """audit.sampling_defaults: what a server uses for the policy fields a request leaves out. `library` (our
    SamplingParams' defaults), `model` (the model's generation_config, as vLLM's `--generation-config auto`
    does), or a mapping of fields; returned as (label, fields)."""
    given = a.get("sampling_defaults", "library")
    if given == "library":
        return "library defaults", {}
    if given == "model":
        return "the model's generation_config", {k: v for k, v in (loaded.generation or {}).items()
                                                 if k in ASSUMED_FIELDS}
    if isinstance(given, dict) and set(given) <= set(ASSUMED_FIELDS):
        try:
            SamplingParams.from_mapping(dict(given))
        except (ConfigError, TypeError, ValueError) as exc:
            raise ConfigError(f"audit.sampling_defaults: {exc}") from None
        return "audit.sampling_defaults", dict(given)
    raise ConfigError(f"audit.sampling_defaults must be library, model or a mapping of {', '.join(ASSUMED_FIELDS)}, "
                      f"got {given!r}")


def assume_sampling(records: list[Transcript], defaults: dict[str, Any]) -> None:
    """Each request that states a policy gets `defaults` (else the library's) for the fields it left out, and
    says which it did not state and what was taken (RequestReport.sampling_assumed)."""
    library = SamplingParams()
    for r in records:
        if r.sampling is None:
            continue  # no policy stated at all: none is checked
        missing = [k for k in ASSUMED_FIELDS if k not in r.sampling]
        r.sampling_assumed = {k: defaults.get(k, getattr(library, k)) for k in missing}
        r.sampling = {**r.sampling, **{k: defaults[k] for k in missing if k in defaults}}


def _policy_params(record: Transcript) -> SamplingParams | None:
    if record.sampling is None:
        return None
    try:
        return SamplingParams.from_mapping(dict(record.sampling))
    except (ConfigError, TypeError, ValueError):
        return None


def _audit_one(record: Transcript, forward: Forward, loaded, atol: float, eos: tuple[int, ...],
               logits: torch.Tensor | None = None) -> RequestReport:
    """One record's checks; `logits` (one row per output token), when the reference computed them already."""
    from toolkit.processors import BatchView, RowState, apply_pipeline, invalid_rows

    rep = RequestReport(record.request_id, record.stream, record.line, record.origin_engine,
                        output_tokens=len(record.output_token_ids), prompt_source=record.prompt_source,
                        sampling_assumed=dict(record.sampling_assumed))
    rep.problems = [{"position": p.position, "token_id": None, "claimed": None, "recomputed": None, "kind": p.kind,
                     "why": p.why} for p in record.problems]
    prompt, output = record.prompt_token_ids, record.output_token_ids
    if not output:
        return rep
    if not prompt:
        rep.problems.append({"position": 0, "token_id": output[0], "claimed": None, "recomputed": None,
                             "kind": "no_prompt", "why": "an empty prompt: the first token has no context"})
        return rep
    tokens = prompt + output
    if logits is None:
        logits = forward(tokens[:-1])[len(prompt) - 1:]
    logits = logits.double()  # row j predicts output[j]
    raw = torch.log_softmax(logits, dim=-1)
    params = _policy_params(record)
    processed = None
    if params is not None:
        positions = range(len(prompt), len(tokens))
        view = BatchView(tuple(RowState(params, tokens[:p], len(prompt)) for p in positions),
                         loaded.arch.vocab_size, logits.device, eos)
        # a row is unusable where its logits hold NaN or +inf: then its log-softmax's max is not finite
        out = apply_pipeline(logits, view, row_errors=invalid_rows(raw.amax(dim=-1))).processed_RV
        processed = raw if out is logits else torch.log_softmax(out.double(), dim=-1)  # no processor: the same
    mode = record.logprobs_mode
    if mode == "processed_logprobs" and processed is None:
        rep.problems.append({"position": len(prompt), "token_id": output[0], "claimed": None, "recomputed": None,
                             "kind": "no_policy", "why": "processed logprobs are claimed but the transcript does not "
                                                         "state the sampling parameters to recompute them"})
        return rep
    claimed_space = processed if mode == "processed_logprobs" else raw
    greedy = params is not None and params.temperature == 0.0
    mass_limit = math.exp(atol)
    argmaxes = (processed if processed is not None else raw).argmax(dim=-1).tolist()
    for j, token in enumerate(output):
        position = len(prompt) + j
        recomputed = float(claimed_space[j, token])
        argmax = argmaxes[j]
        claimed = record.claimed[j]
        check = TokenCheck(record.request_id, record.stream, position, token, claimed, recomputed, None, None, None,
                           None, argmax)
        if claimed is None:
            check.kinds.append("missing_logprob")
            check.why.append("no logprob given for this token")
        elif not math.isfinite(claimed) or not math.isfinite(recomputed):
            check.kinds.append("not_finite")
            check.why.append(f"claimed {claimed!r}, recomputed {recomputed!r}")
        else:
            rep.tokens += 1
            check.abs_error = abs(claimed - recomputed)
            check.ratio = _safe_exp(recomputed - claimed)
            if check.abs_error > atol:
                check.kinds.append("logprob")
                check.why.append(f"claimed {claimed:.6g}, recomputed {recomputed:.6g} (|diff| {check.abs_error:.3g} "
                                 f"> atol {atol:g})")
        top = _unique(record.top[j]) if j < len(record.top) else []
        if top:
            _check_top(check, top, claimed_space[j], atol, mass_limit)
        if processed is not None and not math.isfinite(float(processed[j, token])):
            kept = torch.isfinite(processed[j])
            edge = float(raw[j][kept].min()) if bool(kept.any()) else math.inf
            if float(raw[j, token]) < edge - atol:
                check.kinds.append("outside_support")
                check.why.append(f"token {token} is outside the support the stated sampling parameters give "
                                 f"({int(kept.sum())} tokens kept; its reference logprob {float(raw[j, token]):.4g} "
                                 f"is below the least kept {edge:.4g})")
        if greedy and token != argmax:
            space = processed[j] if math.isfinite(float(processed[j, token])) else raw[j]  # truncated: raw margin
            margin = float(space[argmax] - space[token])
            if margin > atol:
                check.kinds.append("greedy_departure")
                check.why.append(f"greedy token {token} is not the reference's argmax {argmax} (margin {margin:.3g})")
                if rep.first_greedy_departure is None:
                    rep.first_greedy_departure, rep.first_departure_margin = position, margin
        rep.checks.append(check)
    return rep


def _unique(top: list[tuple[int, float]]) -> list[tuple[int, float]]:
    seen: dict[int, float] = {}
    for t, lp in top:
        seen.setdefault(t, lp)
    return list(seen.items())


def _check_top(check: TokenCheck, top: list[tuple[int, float]], reference_V: torch.Tensor, atol: float,
               mass_limit: float) -> None:
    ids = torch.tensor([t for t, _ in top])
    claimed = torch.tensor([lp for _, lp in top], dtype=torch.float64)
    ref = reference_V[ids]
    finite = torch.isfinite(claimed) & torch.isfinite(ref)
    if bool(finite.any()):
        diff = (claimed - ref).abs()[finite]
        check.top_max_abs_error = float(diff.max())
        if check.top_max_abs_error > atol:
            worst = int(torch.argmax((claimed - ref).abs().where(finite, torch.zeros_like(claimed))))
            check.kinds.append("top_logprob")
            check.why.append(f"top alternative {top[worst][0]}: claimed {top[worst][1]:.6g}, recomputed "
                             f"{float(ref[worst]):.6g}")
    mass = float(torch.exp(claimed).sum())
    if mass > mass_limit:
        check.kinds.append("top_logprobs_mass")
        check.why.append(f"top logprobs hold probability {mass:.4g} > 1: not a distribution")
        return
    p, q = torch.exp(claimed), torch.exp(ref)
    kl = float(torch.where(p > 0, p * (claimed - ref), torch.zeros_like(p)).sum())
    p_rest, q_rest = max(0.0, 1.0 - mass), max(0.0, 1.0 - float(q.sum()))
    if p_rest > 0:
        kl += p_rest * (math.log(p_rest) - math.log(q_rest)) if q_rest > 0 else math.inf
    check.kl = max(kl, 0.0)


# ------------------------------------------------------------------------------------------- the mode

def run_audit(cfg: DictConfig, run_dir: Path) -> int:
    from toolkit.models import load_model

    a = OmegaConf.to_container(cfg.audit, resolve=True) if cfg.get("audit") else {}
    source, fmt = a.get("input"), a.get("format", "openai")
    if not source and a.get("sources"):
        return run_engine_mismatch(cfg, run_dir, a)
    if not source:
        raise AuditInputError("mode=audit needs audit.input=<transcript.jsonl> "
                              "(or audit.sources=[hf,server,llama_cpp])")
    if fmt not in FORMATS:
        raise AuditInputError(f"audit.format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    references, atol, detector = _references(a), _atol(a), detector_config(a)
    if launcher(a) == "ray":
        ray_options(a)  # checked before the model loads
    if not Path(source).is_file():
        raise AuditInputError(f"audit.input {source!r} is not a file")
    model_cfg = from_mapping(ModelConfig, OmegaConf.to_container(cfg.model, resolve=True), section="model")
    loaded = load_model(model_cfg, "cpu")
    if loaded.tokenizer is None:
        raise AuditInputError(f"model {model_cfg.name!r} has no tokenizer to read a transcript with")
    try:
        records, line_errors = read_transcripts(source, fmt, loaded.tokenizer, loaded.arch.vocab_size,
                                                a.get("logprobs_mode"))
    except TranscriptError as exc:
        raise AuditInputError(str(exc)) from None
    for e in line_errors:
        print(f"line {e.line}{' (' + e.request_id + ')' if e.request_id else ''}: {e.why}", file=sys.stderr)
    if not records:
        raise AuditInputError(f"no usable request in {source} ({len(line_errors)} lines rejected)")
    defaults_from, defaults = sampling_defaults(a, loaded)
    assume_sampling(records, defaults)
    assumed = sum(bool(r.sampling_assumed) for r in records)
    if assumed:
        print(f"sampling: {assumed} of {len(records)} requests leave policy fields out; taken from {defaults_from} "
              f"(audit.json: sampling_assumed per request)")
    if launcher(a) == "ray":
        options = ray_options(a)
        weights = [_size(r) for r in records]
        found = in_order(run_on_ray(OmegaConf.to_container(cfg.model, resolve=True), options, weights, "audit",
                                    _audit_shard, lambda shard: ([records[i] for i in shard], references, atol)),
                         len(references))
        reports = [AuditReport(source=str(source), fmt=fmt, reference=r, atol=atol, requests=requests,
                               line_errors=list(line_errors)) for r, requests in zip(references, found)]
    else:
        tokens = sum(map(_size, records))
        reports = []
        with progress_bar(tokens * len(references), "audit") as bar:
            for r in references:
                forward, start = stated_reference(loaded, r), time.perf_counter()
                reports.append(audit_transcripts(records, forward, loaded, atol=float(atol), reference=r,
                                                 source=str(source), fmt=fmt, line_errors=line_errors,
                                                 progress=bar.update))
                took = time.perf_counter() - start
                how = (f"packed, {forward.counts['computed']} computed, the rest read from prompt blocks shared "
                       f"in a pack" if hasattr(forward, "many") else "one request at a time")
                rate = tokens / max(took, 1e-9)
                print(f"{r}: {tokens} tokens recomputed in {took:.1f} s ({rate:.0f} tok/s; {how})")
    for report in reports:
        report.sampling_defaults = defaults_from
    detection = None
    if detector is not None:
        memo: dict[str, Forward] = {}
        scales = detector_scales(loaded, detector, memo)
        detection = run_detector(records, loaded, detector, scales, atol=atol,
                                 done={r.reference: r for r in reports}, memo=memo)
    write_converted_trace(run_dir, records, loaded, cfg, source=str(source), fmt=fmt)
    write_audit(run_dir, reports, detection)
    print(format_table(reports))
    if detection is not None:
        print(format_detection(detection))
    print(f"audit.json, audit.parquet, audit.png and the converted trace: {run_dir}")
    return 0 if all(r.passed for r in reports) else 1


STATED_DTYPES = ("float64", "float32", "bfloat16", "float16")  # the formats an audit reference may be stated in


def _references(a: dict) -> list[str]:
    """ours | hf | both, or a list of them, each optionally in a stated format: ours@bfloat16 (our engine's
    own forward of the model in bf16), hf@bfloat16 (HF's model cast to bf16), ours@float64 (= ours)."""
    references = a.get("reference", "ours")
    references = [references] if isinstance(references, str) else list(references)
    if references == ["both"]:
        references = list(REFERENCES)

    def ok(r) -> bool:
        name, _, dtype = str(r).partition("@")
        return name in REFERENCES and (not dtype or dtype in STATED_DTYPES)

    if not references or not all(ok(r) for r in references):
        raise ConfigError(f"audit.reference must be ours, hf, both or a list of them, each optionally @<dtype> "
                          f"({', '.join(STATED_DTYPES)}), got {a.get('reference')!r}")
    return [str(r) for r in references]


def stated_reference(loaded, reference: str):
    """ids -> logits for an audit reference: `ours` / `hf` (toolkit.audit.verify.reference_forward), or one in a
    stated format: ours@float64 is the float64 textbook forward; ours@<float32 | bfloat16 | float16> is our
    engine's own forward (one no-cache prefill, the native kernels where they run) of the model loaded in that
    format, the recomputation a claim from an engine running that format is checked against; hf@<dtype> is HF
    transformers' model cast to it."""
    name, _, dtype = reference.partition("@")
    if not dtype or (name, dtype) == ("ours", "float64"):
        return reference_forward(loaded, name)
    from toolkit.models import load_model

    if name == "ours":
        same = str(loaded.model.embed.dtype).removeprefix("torch.") == dtype
        model = loaded.model if same else load_model(dataclasses.replace(loaded.config, dtype=dtype)).model
        return EngineForward(model)
    from toolkit.models.loading import hf_reference_model, load_checkpoint

    hf = hf_reference_model(load_checkpoint(loaded.config)).to(getattr(torch, dtype))

    @torch.inference_mode()
    def forward(ids: list[int]) -> torch.Tensor:
        return hf(torch.tensor([ids])).logits[0].double()

    return forward


def detector_config(a: dict) -> dict | None:
    """audit.detector: {stated, alternatives, calibrate, scales} checked (None: no alternatives, no detector)."""
    d = a.get("detector")
    if not d or (isinstance(d, dict) and not d.get("alternatives")):
        return None
    if not isinstance(d, dict):
        raise ConfigError(f"audit.detector must be a mapping (stated, alternatives, calibrate, scales), got {d!r}")
    unknown = sorted(set(d) - {"stated", "alternatives", "calibrate", "scales"})
    if unknown:
        raise ConfigError(f"audit.detector: unknown keys {unknown}; known: stated, alternatives, calibrate, scales")
    stated, alternatives = d.get("stated", "float32"), list(d.get("alternatives") or [])
    bad = [f for f in [stated, *alternatives] if f not in DETECTOR_FORMATS]
    if bad:
        raise ConfigError(f"audit.detector: formats must be among {', '.join(DETECTOR_FORMATS)}, got {bad}")
    alternatives = [f for f in dict.fromkeys(alternatives) if f != stated]
    if not alternatives:
        raise ConfigError("audit.detector.alternatives needs at least one format other than the stated one")
    scales = dict(d.get("scales") or {})
    if any(f not in DETECTOR_FORMATS or not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0
           for f, v in scales.items()):
        raise ConfigError(f"audit.detector.scales: a positive number per format, got {scales!r}")
    return {"stated": stated, "alternatives": alternatives, "calibrate": bool(d.get("calibrate", True)),
            "scales": scales}


def _forward(loaded, reference: str, memo: dict[str, Forward] | None) -> Forward:
    """stated_reference, made once per reference where a memo is kept (a 16-bit model loaded once a run)."""
    if memo is None:
        return stated_reference(loaded, reference)
    if reference not in memo:
        memo[reference] = stated_reference(loaded, reference)
    return memo[reference]


def detector_scales(loaded, detector: dict, memo: dict[str, Forward] | None = None) -> dict[str, float]:
    """The hypotheses' widths: measured (calibrate_scales on the built-in passages: HF's forward in each format and,
    for float32, our engine's fp32 one) unless given or switched off."""
    from toolkit.workload import passages

    formats = [detector["stated"], *detector["alternatives"]]
    scales = {f: DEFAULT_SCALES[f] for f in formats}
    todo = [f for f in formats if f not in detector["scales"]]
    if detector["calibrate"] and todo and loaded.tokenizer is not None:
        sequences = [loaded.tokenizer.encode(text)[:96] for text in passages()[:3]]
        scales.update(calibrate_scales(
            todo, [s for s in sequences if len(s) > 1], lambda f: _forward(loaded, RECOMPUTATION[f], memo),
            lambda f: [stated_reference(loaded, r) for r in (f"hf@{f}", f"ours@{f}") if r != RECOMPUTATION[f]]))
    scales.update(detector["scales"])
    return scales


def run_detector(records: list[Transcript], loaded, detector: dict, scales: dict[str, float], *, atol: float,
                 done: dict[str, AuditReport] | None = None, memo: dict[str, Forward] | None = None
                 ) -> dict[str, Any]:
    """Every claim recomputed under each hypothesis (an audit already made with a hypothesis' reference is
    reused), and the detector's answer per request and for the transcript as a whole."""
    formats = [detector["stated"], *detector["alternatives"]]
    residuals = {}
    for f in formats:
        reference = RECOMPUTATION[f]
        report = (done or {}).get(reference) or audit_transcripts(
            records, _forward(loaded, reference, memo), loaded, atol=atol, reference=reference)
        residuals[f] = residuals_of(report)
    detections = detect(residuals, scales, detector["stated"])
    return {"scales": scales, "recomputed_by": {f: RECOMPUTATION[f] for f in formats},
            "transcript": combined(detections, detector["stated"]),
            "requests": [(r.request_id, r.stream, d) for r, d in zip(records, detections)]}


def format_detection(detection: dict[str, Any]) -> str:
    d = detection["transcript"].to_dict()
    if not d["tokens"]:
        return "detector: no token carries a usable claim"
    posterior = ", ".join(f"{f} {p:.3g}" for f, p in d["posterior"].items())
    scales = ", ".join(f"{f} {b:.3g}" for f, b in detection["scales"].items())
    return (f"detector ({d['tokens']} tokens; widths {scales}): {d['verdict']}; llr per token vs the best "
            f"alternative {d['llr_per_token']:.4g}; misfit {d['misfit']:.3g}; posterior {posterior}")


class EngineForward:
    """Our engine's own forward as an audit reference: one sequence (`forward(ids)`), or many packed into
    prefills of up to `max_tokens` computed tokens, a prompt's blocks shared within a pack (`many`), bit for bit
    the same (toolkit.runner.recompute_many). `counts`: the tokens `many` read and those it ran."""

    def __init__(self, model, max_tokens: int = 2048):
        self.model, self.max_tokens = model, max_tokens
        self.counts = {"tokens": 0, "computed": 0}

    def __call__(self, ids: list[int]) -> torch.Tensor:
        from toolkit.runner import recompute_logits

        return recompute_logits(self.model, ids).double()

    def many(self, sequences: list[list[int]], last: list[int]) -> list[torch.Tensor]:
        """fp32 logits of the last `last[i]` positions of each sequence (the caller widens one at a time)."""
        from toolkit.runner import recompute_many

        return recompute_many(self.model, sequences, last, max_tokens=self.max_tokens, counts=self.counts)


def _atol(a: dict) -> float:
    atol = a.get("atol", 1e-4)
    if not (isinstance(atol, (int, float)) and not isinstance(atol, bool) and atol > 0):
        raise ConfigError(f"audit.atol must be a positive number, got {atol!r}")
    return float(atol)


def run_engine_mismatch(cfg: DictConfig, run_dir: Path, a: dict) -> int:
    """experiments/engine_mismatch.yaml: a transcript from each engine available here, each audited; one table
    (source, tokens, max and p99 |d logprob|, KL, share of ratios outside [0.5, 2]) and one histogram PNG."""
    from toolkit.audit import sources as src
    from toolkit.config import EngineConfig
    from toolkit.engine import Engine, load_for
    from toolkit.models import load_model

    names = list(a["sources"])
    unknown = [n for n in names if n not in src.SOURCES]
    if unknown:
        raise ConfigError(f"audit.sources: unknown {unknown}; known: {', '.join(src.SOURCES)}")
    references, atol = _references(a), _atol(a)
    model_cfg = from_mapping(ModelConfig, OmegaConf.to_container(cfg.model, resolve=True), section="model")
    engine_cfg = from_mapping(EngineConfig, OmegaConf.to_container(cfg.engine, resolve=True), section="engine")
    loaded, default_sampling, _ = load_for(model_cfg, engine_cfg, {})
    detector = detector_config(a)
    memo: dict[str, Forward] = {}  # the hypotheses' recomputations, each model loaded once
    scales = detector_scales(loaded, detector, memo) if detector is not None else {}
    detections: dict[str, tuple[str, Detection]] = {}  # source -> (what produced it, the detector's answer)
    chats = list(a.get("prompts") or src.DEFAULT_PROMPTS)
    prompts = [loaded.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in chats]
    max_tokens, k = int(a.get("max_tokens", 32)), int(a.get("top_logprobs", 5))
    out_dir = run_dir / "transcripts"
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, errors = [], {}
    for name in names:
        path = out_dir / f"{name}.jsonl"
        if name == "llama_cpp":
            missing = src.llama_cpp_missing() or (None if model_cfg.name == "smollm2" else
                                                  "llama.cpp runs the SmolLM2 GGUF only (model=smollm2)")
            if missing:
                print(f"{name}: skipped: {missing}", file=sys.stderr)
                continue
            from toolkit.models.loading import smollm2_gguf

            try:
                fmt = src.llama_cpp_transcript(path, smollm2_gguf(), prompts, max_tokens, k)
            except ForeignEngineError as exc:  # its crash is this source's error, not the run's
                print(f"{name}: failed: {exc}", file=sys.stderr)
                continue
        elif name == "hf":
            fmt = src.hf_transcript(path, loaded, prompts, max_tokens, k)
        elif name == "server":
            fmt = src.server_transcript(path, Engine(loaded, engine_cfg, default_sampling), chats, max_tokens, k)
        else:  # server_bf16
            bf16 = load_model(dataclasses.replace(model_cfg, dtype="bfloat16"), engine_cfg.device)
            fmt = src.server_transcript(path, Engine(bf16, engine_cfg, default_sampling), chats, max_tokens, k)
            del bf16
        records, line_errors = read_transcripts(path, fmt, loaded.tokenizer, loaded.arch.vocab_size)
        done: dict[str, AuditReport] = {}
        for reference in references:
            report = audit_transcripts(records, stated_reference(loaded, reference), loaded, atol=atol,
                                       reference=reference, source=str(path), fmt=fmt, line_errors=line_errors)
            d = report.to_dict()
            rows.append({"source": name, "reference": reference, **{key: d[key] for key in (
                "tokens", "flagged_tokens", "max_abs_error", "p50_abs_error", "p99_abs_error", "kl_mean",
                "ratio_mean", "ratio_outside_share", "greedy_departures", "lines_rejected")},
                         "requests": d["requests"]})
            errors[f"{name} vs {reference}"] = [c.abs_error for c in report.checks]
            done[reference] = report
        if detector is not None:
            truth = {"llama_cpp": "llama.cpp Q4_1", "server_bf16": "bfloat16"}.get(name, model_cfg.dtype)
            found = run_detector(records, loaded, detector, scales, atol=atol, done=done, memo=memo)
            detections[name] = (truth, found["transcript"])
    from toolkit.trace.writer import atomic_write_bytes

    table = detection_table(detections, detector["stated"]) if detector is not None else []
    atomic_write_bytes(run_dir / "engine_mismatch.json", json.dumps(
        rows if detector is None else {"audits": rows, "detector": {
            "stated": detector["stated"], "alternatives": detector["alternatives"], "scales": scales,
            "windows": list(WINDOWS), "sources": table}}, indent=2).encode())
    try:
        plot_errors(run_dir / "engine_mismatch.png", errors)
    except ModuleNotFoundError as exc:
        print(f"engine_mismatch.png skipped: {exc}", file=sys.stderr)
    print(f"{'source':<10} {'reference':<9} {'tokens':>6} {'max|d|':>9} {'p50|d|':>9} {'p99|d|':>9} {'KL':>9} "
          f"{'ratio out':>9} {'greedy dep':>10}")
    for r in rows:
        print(f"{r['source']:<10} {r['reference']:<9} {r['tokens']:>6} {_fmt(r['max_abs_error']):>9} "
              f"{_fmt(r['p50_abs_error']):>9} {_fmt(r['p99_abs_error']):>9} {_fmt(r['kl_mean']):>9} "
              f"{_fmt(r['ratio_outside_share'], '.2%'):>9} {r['greedy_departures']:>10}")
    if detector is not None:
        print(format_detection_table(table, detector, scales))
    print(f"engine_mismatch.json, engine_mismatch.png, transcripts/: {run_dir}")
    return 0


def detection_table(detections: dict[str, tuple[str, Detection]], stated: str) -> list[dict[str, Any]]:
    """Per source: the detector's answer on its whole transcript, and per window size n the AUC of telling its
    windows of n tokens from those of the sources that ran the stated format (their windows pooled; the score
    is the llr per token, low meaning "not the stated format"). A source that ran the stated format gets the
    share of its windows the detector accepts (llr > 0) instead."""
    negatives = {n: [x for truth, d in detections.values() if truth == stated for x in window_scores(d, n)]
                 for n in WINDOWS}
    rows = []
    for name, (truth, d) in detections.items():
        row = {"source": name, "produced_by": truth, **d.to_dict()}
        for n in WINDOWS:
            scores = window_scores(d, n)
            row[f"windows_{n}"] = len(scores)
            if truth == stated:
                row[f"accepted_{n}"] = sum(x > 0 for x in scores) / len(scores) if scores else None
            else:
                row[f"auc_{n}"] = auc([-x for x in scores], [-x for x in negatives[n]])
        rows.append(row)
    return rows


def format_detection_table(rows: list[dict[str, Any]], detector: dict, scales: dict[str, float]) -> str:
    widths = ", ".join(f"{f} {b:.3g}" for f, b in scales.items())
    lines = [f"detector: stated {detector['stated']} vs {', '.join(detector['alternatives'])} (widths {widths}); "
             f"AUC of 'not {detector['stated']}' per window of n tokens against the {detector['stated']} sources' "
             f"windows (their share accepted instead), windows in ()",
             f"{'source':<12} {'produced by':<15} {'tokens':>6} {'best':<9} {'llr/token':>9} "
             + " ".join(f"{'n=' + str(n):>14}" for n in WINDOWS)]
    for r in rows:
        cells = []
        for n in WINDOWS:
            v = r.get(f"auc_{n}", r.get(f"accepted_{n}"))
            tag = "" if f"auc_{n}" in r else " ok"
            cells.append(f"{_fmt(v, '.3f') + tag + ' (' + str(r[f'windows_{n}']) + ')':>14}")
        lines.append(f"{r['source']:<12} {r['produced_by']:<15} {r['tokens']:>6} {str(r['best']):<9} "
                     f"{_fmt(r['llr_per_token'], '.3g'):>9} " + " ".join(cells))
    return "\n".join(lines)


def write_audit(run_dir: Path, reports: list[AuditReport], detection: dict[str, Any] | None = None) -> dict[str, Any]:
    from toolkit.trace.writer import atomic_write_bytes, atomic_write_table

    first = reports[0].to_dict()
    if len(reports) > 1:
        first["by_reference"] = {r.reference: r.to_dict() for r in reports}
        first["passed"] = all(r.passed for r in reports)
    if detection is not None:
        first["detector"] = {"scales": detection["scales"], "recomputed_by": detection["recomputed_by"],
                             **detection["transcript"].to_dict(),
                             "requests": [{"request_id": rid, "stream": stream, **d.to_dict()}
                                          for rid, stream, d in detection["requests"]]}
    rows = [{"reference": r.reference, **{k: v for k, v in c.__dict__.items() if k not in ("kinds", "why")},
             "kinds": ",".join(c.kinds), "why": "; ".join(c.why)} for r in reports for c in r.checks]
    atomic_write_table(run_dir / "audit.parquet", pa.Table.from_pylist(rows) if rows else
                       pa.table({"request_id": pa.array([], pa.string())}))
    atomic_write_bytes(run_dir / "audit.json", json.dumps(first, indent=2, allow_nan=True).encode())
    try:
        plot_errors(run_dir / "audit.png", {f"{', '.join(sorted({q.origin_engine for q in r.requests}))} vs "
                                            f"{r.reference}": [c.abs_error for c in r.checks] for r in reports})
    except ModuleNotFoundError as exc:
        print(f"audit.png skipped: {exc}", file=sys.stderr)
    return first


def plot_errors(path: Path, errors_by_source: dict[str, list[float | None]]) -> None:
    """One PNG: a histogram of |claimed - recomputed| logprob per source, on a log axis."""
    from toolkit.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    floor = 1e-9
    values = {k: [max(e, floor) for e in v if e is not None] for k, v in errors_by_source.items()}
    top = max((max(v) for v in values.values() if v), default=1.0)
    bins = torch.logspace(math.log10(floor), math.log10(max(top, 1e-6) * 2), 60).tolist()
    for name, v in values.items():
        if v:
            ax.hist(v, bins=bins, histtype="step", linewidth=1.5, label=f"{name} ({len(v)} tokens)")
    ax.set_xscale("log")
    ax.set_xlabel("|claimed - recomputed| logprob (errors below 1e-9 drawn at 1e-9)")
    ax.set_ylabel("tokens")
    ax.set_title("logprob error per source")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(v: Any, spec: str = ".3g") -> str:
    return "-" if v is None else format(v, spec)


def format_table(reports: list[AuditReport], limit: int = 20) -> str:
    lines = []
    for report in reports:
        d = report.to_dict()
        lines.append(f"audit of {d['source']} ({d['format']}, {', '.join(d['origin_engines'])}) against the "
                     f"{report.reference} reference, atol {report.atol:g}")
        head = (f"{'request':<28} {'tokens':>6} {'max|d|':>9} {'p99|d|':>9} {'KL':>9} {'ratio out':>9} "
                f"{'seq ratio':>9} {'greedy dep':>10} {'flagged':>7}")
        lines.append(head)
        shown = [r for r in d["requests"] if r["flagged"]][:limit] or d["requests"][:limit]
        for r in shown:
            name = r["request_id"] + (f"#{r['stream']}" if r["stream"] else "")
            lines.append(f"{name[:28]:<28} {r['tokens']:>6} {_fmt(r['max_abs_error']):>9} "
                         f"{_fmt(r['p99_abs_error']):>9} "
                         f"{_fmt(r['kl_mean']):>9} {_fmt(r['ratio_outside_share'], '.1%'):>9} "
                         f"{_fmt(r['sequence_ratio']):>9} {_fmt(r['first_greedy_departure'], 'd'):>10} "
                         f"{len(r['flagged']):>7}")
            for f in r["flagged"][:3]:
                lines.append(f"    position {f['position']}: {f['kind']}: {f['why']}")
        if len(d["requests"]) > len(shown):
            lines.append(f"  ... {len(d['requests']) - len(shown)} more requests in audit.json")
        verdict = "PASSED" if report.passed else "FLAGGED"
        lines.append(f"{verdict}: {d['tokens']} tokens of {len(d['requests'])} requests; "
                     f"{d['flagged_tokens']} flagged; "
                     f"max |d| {_fmt(d['max_abs_error'])}, p50 {_fmt(d['p50_abs_error'])}, p99 "
                     f"{_fmt(d['p99_abs_error'])}; KL mean {_fmt(d['kl_mean'])}; ratio mean {_fmt(d['ratio_mean'])}, "
                     f"max {_fmt(d['ratio_max'])}, outside [0.5, 2] {_fmt(d['ratio_outside_share'], '.2%')}; "
                     f"greedy departures {d['greedy_departures']}; lines rejected {d['lines_rejected']}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- the trace

def write_converted_trace(run_dir: Path, records: list[Transcript], loaded, cfg: DictConfig, *, source: str,
                          fmt: str) -> None:
    """The transcript in our trace schema: what the other engine claimed, where our engine would record it
    (raw claims in raw_logprob / top_raw, processed ones in processed_logprob / top_processed). Fields only
    an engine run has (step, noise, logits digest, batch) are null."""
    from toolkit.trace.schema import SAMPLES_SCHEMA, SCHEMA_VERSION
    from toolkit.trace.writer import SAMPLES_DIR, atomic_write_bytes, atomic_write_table, write_manifest, write_requests
    from toolkit.version import __version__

    run_id = uuid.uuid4().hex[:12]
    samples, requests = [], []
    for r in records:
        params = _policy_params(r)
        policy = {k: getattr(params, k) for k in ("temperature", "top_k", "top_p", "min_p")} if params else {}
        processed = r.logprobs_mode == "processed_logprobs"
        for j, token in enumerate(r.output_token_ids):
            top = [{"token_id": t, "logprob": lp} for t, lp in _unique(r.top[j])] if j < len(r.top) else []
            last = j == len(r.output_token_ids) - 1
            samples.append({"run_id": run_id, "request_id": r.request_id, "stream": r.stream,
                            "position": len(r.prompt_token_ids) + j, "token_id": token,
                            "raw_logprob": None if processed else r.claimed[j],
                            "processed_logprob": r.claimed[j] if processed else None,
                            "top_raw": [] if processed else top, "top_processed": top if processed else [],
                            "processors": [], "noise": float("nan"), **policy,
                            "finish_reason": r.finish_reason if last else None, "origin": "plain",
                            "spec_proposed": 0, "spec_accepted": 0})
        sampling = {k: v for k, v in (r.sampling or {}).items()}
        requests.append({"run_id": run_id, "request_id": r.request_id, "stream": r.stream,
                         "prompt_token_ids": r.prompt_token_ids, "prompt_text": r.prompt_text,
                         "sampling_params": json.dumps(sampling), "output_token_ids": r.output_token_ids,
                         "output_text": r.output_text, "finish_reason": r.finish_reason,
                         "origin_engine": r.origin_engine, "source_record": r.source})
    run_dir.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(samples, schema=SAMPLES_SCHEMA)
    atomic_write_table(run_dir / SAMPLES_DIR / "part-000000.parquet", table)
    write_requests(run_dir, requests)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    atomic_write_bytes(run_dir / "config.yaml", OmegaConf.to_yaml(resolved).encode())
    write_manifest(run_dir, {"schema_version": SCHEMA_VERSION, "run_id": run_id, "converted_from": source,
                             "format": fmt, "origin_engines": sorted({r.origin_engine for r in records}),
                             "model_name": loaded.name, "model_id": loaded.model_id,
                             "weights_sha256": loaded.revision,
                             "tokenizer_sha256": loaded.tokenizer.digest if loaded.tokenizer else None,
                             "toolkit_version": __version__})
