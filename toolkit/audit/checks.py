"""The audit's checks of one transcript against a reference's recomputation (toolkit.audit.foreign runs them as
`mode=audit`): per token, |claimed - recomputed|, the importance ratio, the top alternatives and their KL, the
support the stated policy gives, greedy departures; per request and overall, their statistics. `audit_transcripts`
recomputes each request on its own (packed where the reference can: toolkit.audit.references.EngineForward)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from toolkit.audit.records import LineError, Transcript, lines_rejected
from toolkit.errors import ConfigError, ToolkitError
from toolkit.runs.metrics import percentile
from toolkit.sampling.params import SamplingParams
from toolkit.sampling.processors import BatchView, RowState, apply_pipeline, invalid_rows

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
    constrained: str | None = None  # the grammar field the request set: its greedy choices and support not checked

    def flagged(self) -> list[dict]:
        out = [
            {
                "position": c.position,
                "token_id": c.token_id,
                "claimed": c.claimed,
                "recomputed": c.recomputed,
                "kind": ",".join(c.kinds),
                "why": "; ".join(c.why),
            }
            for c in self.checks
            if c.kinds
        ]
        out += [dict(p) for p in self.problems]
        return sorted(out, key=lambda f: f["position"])

    def to_dict(self) -> dict[str, Any]:
        errors = [c.abs_error for c in self.checks if c.abs_error is not None]
        ratios = [c.ratio for c in self.checks if c.ratio is not None]
        kls = [c.kl for c in self.checks if c.kl is not None]
        flagged = self.flagged()
        log_product = sum(math.log(r) for r in ratios if r > 0) if ratios and all(r > 0 for r in ratios) else None
        return {
            "request_id": self.request_id,
            "stream": self.stream,
            "line": self.line,
            "origin_engine": self.origin_engine,
            "prompt": self.prompt_source,
            "sampling_assumed": self.sampling_assumed,
            "constrained": self.constrained,
            "tokens": self.tokens,
            "output_tokens": self.output_tokens,
            **_error_stats(errors),
            **_ratio_stats(ratios),
            "sequence_log_ratio": log_product,
            "sequence_ratio": _safe_exp(log_product),
            "kl_mean": sum(kls) / len(kls) if kls else None,
            "kl_max": max(kls) if kls else None,
            "first_greedy_departure": self.first_greedy_departure,
            "first_departure_margin": self.first_departure_margin,
            "first_flagged_position": flagged[0]["position"] if flagged else None,
            "flagged": flagged,
        }


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
        return {
            "source": self.source,
            "format": self.fmt,
            "origin_engines": engines,
            "reference": self.reference,
            "atol": self.atol,
            "sampling_defaults": self.sampling_defaults,
            "passed": self.passed,
            "tokens": len(errors),
            "flagged_tokens": self.flagged_tokens,
            **_error_stats(errors),
            **_ratio_stats(ratios),
            "kl_mean": sum(kls) / len(kls) if kls else None,
            "kl_max": max(kls) if kls else None,
            "kl_tokens": len(kls),
            "sequence_ratio_min": min(seq) if seq else None,
            "sequence_ratio_max": max(seq) if seq else None,
            "greedy_departures": sum(r.first_greedy_departure is not None for r in self.requests),
            "requests_flagged": sum(bool(r["flagged"]) for r in per_request),
            "lines_rejected": lines_rejected(self.line_errors),
            "line_errors": [{"line": e.line, "request_id": e.request_id, "why": e.why} for e in self.line_errors],
            "requests": per_request,
        }


def _safe_exp(x: float | None) -> float | None:
    if x is None:
        return None
    return math.exp(x) if x < 700 else math.inf


def _error_stats(errors: list[float]) -> dict[str, float | None]:
    if not errors:
        return {"max_abs_error": None, "p50_abs_error": None, "p99_abs_error": None, "mean_abs_error": None}
    return {
        "max_abs_error": max(errors),
        "p50_abs_error": percentile(errors, 50),
        "p99_abs_error": percentile(errors, 99),
        "mean_abs_error": sum(errors) / len(errors),
    }


def _ratio_stats(ratios: list[float]) -> dict[str, float | None]:
    if not ratios:
        return {"ratio_mean": None, "ratio_min": None, "ratio_max": None, "ratio_outside_share": None}
    lo, hi = RATIO_BAND
    return {
        "ratio_mean": sum(ratios) / len(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratio_outside_share": sum(not lo <= r <= hi for r in ratios) / len(ratios),
    }


Forward = Callable[[list[int]], torch.Tensor]  # token ids -> float64 logits (T, V), row t predicts token t + 1


def audit_transcripts(
    records: list[Transcript],
    forward: Forward,
    loaded,
    *,
    atol: float,
    reference: str,
    source: str = "",
    fmt: str = "",
    line_errors: list[LineError] | None = None,
    progress: Callable[[int], Any] | None = None,
) -> AuditReport:
    """Each record recomputed on its own (so its values never depend on the others: toolkit.reproduce.shard);
    `progress` is told each record's tokens as it is done."""
    report = AuditReport(source=source, fmt=fmt, reference=reference, atol=atol, line_errors=list(line_errors or []))
    eos = tuple(sorted(set(loaded.arch.eos_token_ids)))
    many = getattr(forward, "many", None)  # a reference that packs several records in one forward
    for group in _groups(records, getattr(forward, "max_tokens", 0) if many else 0):
        todo = [r for r in group if r.prompt_token_ids and r.output_token_ids]
        packed = (
            dict(
                zip(
                    map(id, todo),
                    many(
                        [(r.prompt_token_ids + r.output_token_ids)[:-1] for r in todo],
                        [len(r.output_token_ids) for r in todo],
                    ),
                )
            )
            if many and todo
            else {}
        )
        for record in group:
            report.requests.append(_audit_one(record, forward, loaded, atol, eos, packed.get(id(record))))
            if progress is not None:
                progress(_size(record))
    return report


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
        return "the model's generation_config", {
            k: v for k, v in (loaded.generation or {}).items() if k in ASSUMED_FIELDS
        }
    if isinstance(given, dict) and set(given) <= set(ASSUMED_FIELDS):
        try:
            SamplingParams.from_mapping(dict(given))
        except (ConfigError, TypeError, ValueError) as exc:
            raise ConfigError(f"audit.sampling_defaults: {exc}") from None
        return "audit.sampling_defaults", dict(given)
    raise ConfigError(
        f"audit.sampling_defaults must be library, model or a mapping of {', '.join(ASSUMED_FIELDS)}, got {given!r}"
    )


def assume_sampling(records: list[Transcript], defaults: dict[str, Any]) -> list[LineError]:
    """Each request that states a policy gets `defaults` (else the library's) for the fields it left out, and
    says which it did not state and what was taken (RequestReport.sampling_assumed). A request whose stated fields
    and the defaults make no policy (a default top_k its stated `processors` leave out) leaves `records`, its line
    an error returned: never audited without its greedy and support checks."""
    library, kept, rejected = SamplingParams(), [], {}
    for r in records:
        if r.sampling is not None:  # none stated at all: none is checked
            missing = [k for k in ASSUMED_FIELDS if k not in r.sampling]
            r.sampling_assumed = {k: defaults.get(k, getattr(library, k)) for k in missing}
            r.sampling = {**r.sampling, **{k: defaults[k] for k in missing if k in defaults}}
            try:
                SamplingParams.from_mapping(dict(r.sampling))
            except (ConfigError, TypeError, ValueError) as exc:
                taken = ", ".join(f"{k}={defaults[k]!r}" for k in missing if k in defaults) or "none"
                why = f"the stated sampling with the defaults assumed ({taken}): {exc}"
                rejected.setdefault(r.line, LineError(r.line, r.request_id, why))
                continue
        kept.append(r)
    records[:] = [r for r in kept if r.line not in rejected]  # a line's requests share its policy
    return list(rejected.values())


def _policy_params(record: Transcript) -> SamplingParams | None:
    """The stated policy (None: none stated); the reader refused a line whose policy is none (records.check_policy,
    assume_sampling), so a ConfigError here is raised, never read as "no policy" (that turned the checks off)."""
    return None if record.sampling is None else SamplingParams.from_mapping(dict(record.sampling))


def _audit_one(
    record: Transcript, forward: Forward, loaded, atol: float, eos: tuple[int, ...], logits: torch.Tensor | None = None
) -> RequestReport:
    """One record's checks; `logits` (one row per output token), when the reference computed them already."""
    rep = RequestReport(
        record.request_id,
        record.stream,
        record.line,
        record.origin_engine,
        output_tokens=len(record.output_token_ids),
        prompt_source=record.prompt_source,
        sampling_assumed=dict(record.sampling_assumed),
        constrained=record.constrained,
    )
    rep.problems = [_problem(p.position, None, p.kind, p.why) for p in record.problems]
    prompt, output = record.prompt_token_ids, record.output_token_ids
    if not output:
        return rep
    if not prompt:
        rep.problems.append(_problem(0, output[0], "no_prompt", "an empty prompt: the first token has no context"))
        return rep
    tokens = prompt + output
    if logits is None:
        logits = forward(tokens[:-1])[len(prompt) - 1 :]
    logits = logits.double()  # row j predicts output[j]
    raw = torch.log_softmax(logits, dim=-1)
    params = _policy_params(record)
    processed = None
    if params is not None and not record.constrained:  # under a grammar not rebuilt, nothing reads the processed
        positions = range(len(prompt), len(tokens))
        view = BatchView(
            tuple(RowState(params, tokens[:p], len(prompt)) for p in positions),
            loaded.arch.vocab_size,
            logits.device,
            eos,
        )
        # a row is unusable where its logits hold NaN or +inf: then its log-softmax's max is not finite
        out = apply_pipeline(logits, view, row_errors=invalid_rows(raw.amax(dim=-1))).processed_RV
        processed = raw if out is logits else torch.log_softmax(out.double(), dim=-1)  # no processor: the same
    mode = record.logprobs_mode
    if mode == "processed_logprobs" and record.constrained:
        why = f"processed logprobs under {record.constrained}: they depend on its grammar's mask, not rebuilt here"
        rep.problems.append(_problem(len(prompt), output[0], "constrained", why))
        return rep
    if mode == "processed_logprobs" and processed is None:
        why = (
            "processed logprobs are claimed but the transcript does not state the sampling parameters to recompute them"
        )
        rep.problems.append(_problem(len(prompt), output[0], "no_policy", why))
        return rep
    claimed_space = processed if mode == "processed_logprobs" else raw
    # a grammar's mask (not rebuilt) decides the greedy choice, the support and the alternatives: only the sampled
    # tokens' raw logprobs are checked, one-sided (vLLM takes its logprobs after the mask: renormalised over the
    # allowed tokens, a logprob is raised, never lowered)
    greedy = params is not None and params.temperature == 0.0 and not record.constrained
    mass_limit = math.exp(atol)
    argmaxes = (processed if processed is not None else raw).argmax(dim=-1).tolist()
    for j, token in enumerate(output):
        position = len(prompt) + j
        recomputed = float(claimed_space[j, token])
        argmax = argmaxes[j]
        claimed = record.claimed[j]
        check = TokenCheck(
            record.request_id, record.stream, position, token, claimed, recomputed, None, None, None, None, argmax
        )
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
            if check.abs_error > atol and not (record.constrained and claimed > recomputed):
                check.kinds.append("logprob")
                check.why.append(
                    f"claimed {claimed:.6g}, recomputed {recomputed:.6g} (|diff| {check.abs_error:.3g} > atol {atol:g})"
                )
        top = _unique(record.top[j]) if j < len(record.top) and not record.constrained else []
        if top:
            _check_top(check, top, claimed_space[j], atol, mass_limit)
        if processed is not None and not math.isfinite(float(processed[j, token])):
            kept = torch.isfinite(processed[j])
            edge = float(raw[j][kept].min()) if bool(kept.any()) else math.inf
            if float(raw[j, token]) < edge - atol:
                check.kinds.append("outside_support")
                check.why.append(
                    f"token {token} is outside the support the stated sampling parameters give "
                    f"({int(kept.sum())} tokens kept; its reference logprob {float(raw[j, token]):.4g} "
                    f"is below the least kept {edge:.4g})"
                )
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


def _check_top(
    check: TokenCheck, top: list[tuple[int, float]], reference_V: torch.Tensor, atol: float, mass_limit: float
) -> None:
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
            check.why.append(
                f"top alternative {top[worst][0]}: claimed {top[worst][1]:.6g}, recomputed {float(ref[worst]):.6g}"
            )
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


def _fmt(v: Any, spec: str = ".3g") -> str:
    return "-" if v is None else format(v, spec)


def _problem(position: int, token_id: int | None, kind: str, why: str) -> dict:
    return {"position": position, "token_id": token_id, "claimed": None, "recomputed": None, "kind": kind, "why": why}
