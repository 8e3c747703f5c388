"""Which precision produced a transcript: a likelihood-ratio test over the per-token logprob residuals.

Each hypothesis is the stated model run in one format (float32, bfloat16, float16). The audit recomputes every
claimed token's logprob under each one (float32: our float64 textbook forward, which an fp32 engine misses only
by its own rounding; bfloat16 / float16: our engine's forward of the model loaded in that format), and takes the
residual d = claimed - recomputed. An engine that really ran a format differs from any other implementation of
that format by rounding only, so under hypothesis h

    d ~ (1 - eps) Laplace(0, b_h) + eps Uniform(-R, R)

where b_h is the format's spread: the mean |d| between two independent implementations of it (HF transformers
and ours, teacher-forced on the same tokens: `calibrate_scales`), and the small uniform share keeps one broken
token from deciding the test alone. Per request (and per whole transcript) the log-likelihoods L_h are summed
over the tokens that carry a claim; the detector reports the best hypothesis, the posterior of each under equal
priors, and the score

    llr = (L_stated - max over the alternatives of L_h) / tokens

positive when the stated format explains the claims better than every alternative. A transcript from another
engine (say llama.cpp on 4-bit weights) fits none of them: its llr against the stated format is strongly
negative, which is what `experiment=engine_mismatch` turns into a detection AUC per window of 16 / 64 / 256 tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

FORMATS = ("float32", "bfloat16", "float16")
# the audit reference that recomputes each hypothesis (toolkit.audit.references.stated_reference)
RECOMPUTATION = {"float32": "ours", "bfloat16": "ours@bfloat16", "float16": "ours@float16"}
# b_h when not calibrated: what calibrate_scales measured on SmolLM2 (docs/logprobs.md, "Which format wrote it")
DEFAULT_SCALES = {"float32": 7e-6, "bfloat16": 0.05, "float16": 0.007}
OUTLIER_SHARE, OUTLIER_RANGE = 0.01, 30.0
SCALE_FLOOR = 1e-8  # a format whose two implementations agree to the bit still gets a width
MISFIT_LIMIT = 3.0  # mean |d| / width above which the best hypothesis is said to fit badly
WINDOWS = (16, 64, 256)

Forward = Callable[[list[int]], torch.Tensor]


def token_loglik(residuals: torch.Tensor, scale: float) -> torch.Tensor:
    """log density of each residual under one hypothesis: Laplace(0, scale) with a uniform share for outliers."""
    d = residuals.double().abs()
    laplace = -d / scale - math.log(2.0 * scale) + math.log1p(-OUTLIER_SHARE)
    outlier = math.log(OUTLIER_SHARE / (2.0 * OUTLIER_RANGE))
    return torch.logaddexp(laplace, torch.full_like(laplace, outlier))


@dataclass
class Detection:
    """The detector's answer for one request (or, summed, for a whole transcript)."""

    tokens: int
    loglik: dict[str, float]
    stated: str
    # per token, per hypothesis: the log densities, in position order (for windows of n tokens)
    per_token: dict[str, list[float]] = field(default_factory=dict, repr=False)
    mean_abs: dict[str, float] = field(default_factory=dict)  # mean |d| per hypothesis
    scales: dict[str, float] = field(default_factory=dict)

    @property
    def misfit(self) -> float | None:
        """mean |d| under the best hypothesis (the stated one where none is best) over its width: ~1 when that
        format explains the claims (the Laplace fit), far above when none of the hypotheses does (another engine
        altogether)."""
        at = self.best or self.stated
        return self.mean_abs[at] / self.scales[at] if self.tokens and self.scales else None

    @property
    def tied(self) -> list[str]:
        """The hypotheses sharing the highest log-likelihood: more than one where the claims favour no format (every
        residual past each format's Laplace width scores the same outlier density under all of them)."""
        top = max(self.loglik.values(), default=None)
        return [h for h, v in self.loglik.items() if v == top] if self.tokens else []

    @property
    def best(self) -> str | None:
        """The hypothesis with the highest log-likelihood; None on a tie (the stated format is not favoured then)."""
        tied = self.tied
        return tied[0] if len(tied) == 1 else None

    @property
    def posterior(self) -> dict[str, float]:
        if not self.tokens:
            return {}
        top = max(self.loglik.values())
        weights = {h: math.exp(v - top) for h, v in self.loglik.items()}
        total = sum(weights.values())
        return {h: w / total for h, w in weights.items()}

    @property
    def llr(self) -> float | None:
        """(L_stated - the best alternative's L) per token; None without tokens or alternatives."""
        alternatives = [v for h, v in self.loglik.items() if h != self.stated]
        if not self.tokens or not alternatives:
            return None
        return (self.loglik[self.stated] - max(alternatives)) / self.tokens

    def verdict(self) -> str | None:
        if not self.tokens:
            return None
        if self.best is None:
            said = f"no format is favoured: the claims score alike under {', '.join(self.tied)}"
        elif self.best == self.stated:
            said = "consistent with the stated format"
        else:
            said = f"better explained by {self.best} than by the stated {self.stated}"
        misfit = self.misfit
        if misfit is not None and misfit > MISFIT_LIMIT:
            said += (
                f", but it fits none of the formats: its mean |d| under {self.best or self.stated} is {misfit:.3g} "
                f"times that format's width"
            )
        return said

    def to_dict(self) -> dict[str, Any]:
        return {
            "stated": self.stated,
            "tokens": self.tokens,
            "best": self.best,
            "llr_per_token": self.llr,
            "posterior": self.posterior,
            "loglik": self.loglik,
            "mean_abs_residual": self.mean_abs,
            "misfit": self.misfit,
            "verdict": self.verdict(),
        }


def detect(residuals: dict[str, list[torch.Tensor]], scales: dict[str, float], stated: str) -> list[Detection]:
    """One Detection per request from its residuals under each hypothesis (hypothesis -> one tensor per request,
    NaN where a token has no usable claim; the same positions in every hypothesis)."""
    if stated not in residuals:
        raise ValueError(f"the stated format {stated!r} is not among the hypotheses {sorted(residuals)}")
    counts = {len(v) for v in residuals.values()}
    if len(counts) != 1:
        raise ValueError("every hypothesis needs the residuals of the same requests")
    out = []
    for i in range(counts.pop()):
        rows = {h: r[i].double() for h, r in residuals.items()}
        usable = torch.stack([torch.isfinite(r) for r in rows.values()]).all(0)
        per_token = {h: token_loglik(r[usable], scales[h]) for h, r in rows.items()}
        out.append(
            Detection(
                int(usable.sum()),
                {h: float(v.sum()) for h, v in per_token.items()},
                stated,
                {h: v.tolist() for h, v in per_token.items()},
                {h: float(r[usable].abs().mean()) if bool(usable.any()) else math.nan for h, r in rows.items()},
                {h: scales[h] for h in rows},
            )
        )
    return out


def combined(detections: Iterable[Detection], stated: str) -> Detection:
    """The transcript as a whole: the requests' log-likelihoods summed (their tokens in order)."""
    detections = list(detections)
    hypotheses = list(detections[0].loglik) if detections else []
    per_token = {h: [x for d in detections for x in d.per_token.get(h, [])] for h in hypotheses}
    tokens = sum(d.tokens for d in detections)
    mean_abs = {
        h: sum(d.mean_abs[h] * d.tokens for d in detections if d.tokens) / tokens if tokens else math.nan
        for h in hypotheses
    }
    return Detection(
        tokens,
        {h: sum(d.loglik[h] for d in detections) for h in hypotheses},
        stated,
        per_token,
        mean_abs,
        dict(detections[0].scales) if detections else {},
    )


def window_scores(detection: Detection, n: int) -> list[float]:
    """llr per token over consecutive windows of n claimed tokens (the last partial window dropped)."""
    stated = detection.per_token[detection.stated]
    alternatives = [v for h, v in detection.per_token.items() if h != detection.stated]
    scores = []
    for start in range(0, detection.tokens - n + 1, n):
        own = sum(stated[start : start + n])
        scores.append((own - max(sum(v[start : start + n]) for v in alternatives)) / n)
    return scores


def auc(positives: Sequence[float], negatives: Sequence[float]) -> float | None:
    """P(a positive scores above a negative), ties counting half (Mann-Whitney); None if either side is empty."""
    if not positives or not negatives:
        return None
    wins = sum((p > q) + 0.5 * (p == q) for p in positives for q in negatives)
    return wins / (len(positives) * len(negatives))


def residuals_of(reports) -> list[torch.Tensor]:
    """claimed - recomputed per request of one AuditReport (NaN where a token carries no usable claim)."""
    out = []
    for request in reports.requests:
        out.append(
            torch.tensor(
                [c.claimed - c.recomputed if c.abs_error is not None else math.nan for c in request.checks],
                dtype=torch.float64,
            )
        )
    return out


def calibrate_scales(
    formats: Sequence[str],
    sequences: Sequence[list[int]],
    recompute: Callable[[str], Forward],
    implementations: Callable[[str], Sequence[Forward]],
) -> dict[str, float]:
    """b_h per format: the mean |logprob an implementation of that format gives - the hypothesis' recomputation|
    of each next token of `sequences`, teacher-forced, the largest over the implementations given (for float32:
    HF's and our engine's fp32 forwards against the float64 reference; for a 16-bit format: HF's model in it
    against our engine's). `recompute(format)` and `implementations(format)` give the forwards (ids -> logits)."""
    scales = {}
    for fmt in formats:
        reference = recompute(fmt)
        targets = [torch.tensor(ids[1:])[:, None] for ids in sequences]
        expected = [
            torch.log_softmax(reference(ids[:-1]).double(), -1).gather(1, t) for ids, t in zip(sequences, targets)
        ]
        widths = []
        for forward in implementations(fmt):
            d = torch.cat(
                [
                    (torch.log_softmax(forward(ids[:-1]).double(), -1).gather(1, t) - e).abs().flatten()
                    for ids, t, e in zip(sequences, targets, expected)
                ]
            )
            widths.append(float(d.mean()))
        scales[fmt] = max(max(widths), SCALE_FLOOR) if widths else DEFAULT_SCALES[fmt]
    return scales
