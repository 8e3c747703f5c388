"""The detector as the audit runs it: `audit.detector` checked, the hypotheses' widths calibrated, every claim
recomputed under each hypothesis and toolkit.audit.detector's likelihood-ratio answer per request, per transcript
and (experiment=engine_mismatch) as an AUC table."""

from __future__ import annotations

from typing import Any

from toolkit.audit.checks import AuditReport, Forward, _fmt, audit_transcripts
from toolkit.audit.detector import (
    DEFAULT_SCALES,
    RECOMPUTATION,
    WINDOWS,
    Detection,
    auc,
    calibrate_scales,
    combined,
    detect,
    residuals_of,
    window_scores,
)
from toolkit.audit.detector import FORMATS as DETECTOR_FORMATS
from toolkit.audit.records import Transcript
from toolkit.audit.references import _forward, stated_reference
from toolkit.data import passages
from toolkit.errors import ConfigError


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
    if any(
        f not in DETECTOR_FORMATS or not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0
        for f, v in scales.items()
    ):
        raise ConfigError(f"audit.detector.scales: a positive number per format, got {scales!r}")
    return {
        "stated": stated,
        "alternatives": alternatives,
        "calibrate": bool(d.get("calibrate", True)),
        "scales": scales,
    }


def detector_scales(loaded, detector: dict, memo: dict[str, Forward] | None = None) -> dict[str, float]:
    """The hypotheses' widths: measured (calibrate_scales on the built-in passages: HF's forward in each format and,
    for float32, our engine's fp32 one) unless given or switched off."""
    formats = [detector["stated"], *detector["alternatives"]]
    scales = {f: DEFAULT_SCALES[f] for f in formats}
    todo = [f for f in formats if f not in detector["scales"]]
    if detector["calibrate"] and todo and loaded.tokenizer is not None:
        sequences = [loaded.tokenizer.encode(text)[:96] for text in passages()[:3]]
        scales.update(
            calibrate_scales(
                todo,
                [s for s in sequences if len(s) > 1],
                lambda f: _forward(loaded, RECOMPUTATION[f], memo),
                lambda f: [stated_reference(loaded, r) for r in (f"hf@{f}", f"ours@{f}") if r != RECOMPUTATION[f]],
            )
        )
    scales.update(detector["scales"])
    return scales


def run_detector(
    records: list[Transcript],
    loaded,
    detector: dict,
    scales: dict[str, float],
    *,
    atol: float,
    done: dict[str, AuditReport] | None = None,
    memo: dict[str, Forward] | None = None,
) -> dict[str, Any]:
    """Every claim recomputed under each hypothesis (an audit already made with a hypothesis' reference is
    reused), and the detector's answer per request and for the transcript as a whole."""
    formats = [detector["stated"], *detector["alternatives"]]
    residuals = {}
    for f in formats:
        reference = RECOMPUTATION[f]
        report = (done or {}).get(reference) or audit_transcripts(
            records, _forward(loaded, reference, memo), loaded, atol=atol, reference=reference
        )
        residuals[f] = residuals_of(report)
    detections = detect(residuals, scales, detector["stated"])
    return {
        "scales": scales,
        "recomputed_by": {f: RECOMPUTATION[f] for f in formats},
        "transcript": combined(detections, detector["stated"]),
        "requests": [(r.request_id, r.stream, d) for r, d in zip(records, detections)],
    }


def format_detection(detection: dict[str, Any]) -> str:
    d = detection["transcript"].to_dict()
    if not d["tokens"]:
        return "detector: no token carries a usable claim"
    posterior = ", ".join(f"{f} {p:.3g}" for f, p in d["posterior"].items())
    scales = ", ".join(f"{f} {b:.3g}" for f, b in detection["scales"].items())
    return (
        f"detector ({d['tokens']} tokens; widths {scales}): {d['verdict']}; llr per token vs the best "
        f"alternative {d['llr_per_token']:.4g}; misfit {d['misfit']:.3g}; posterior {posterior}"
    )


def detection_table(detections: dict[str, tuple[str, Detection]], stated: str) -> list[dict[str, Any]]:
    """Per source: the detector's answer on its whole transcript, and per window size n the AUC of telling its
    windows of n tokens from those of the sources that ran the stated format (their windows pooled; the score
    is the llr per token, low meaning "not the stated format"). A source that ran the stated format gets the
    share of its windows the detector accepts (llr > 0) instead."""
    negatives = {
        n: [x for truth, d in detections.values() if truth == stated for x in window_scores(d, n)] for n in WINDOWS
    }
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
    lines = [
        f"detector: stated {detector['stated']} vs {', '.join(detector['alternatives'])} (widths {widths}); "
        f"AUC of 'not {detector['stated']}' per window of n tokens against the {detector['stated']} sources' "
        f"windows (their share accepted instead), windows in ()",
        f"{'source':<12} {'produced by':<15} {'tokens':>6} {'best':<9} {'llr/token':>9} "
        + " ".join(f"{'n=' + str(n):>14}" for n in WINDOWS),
    ]
    for r in rows:
        cells = []
        for n in WINDOWS:
            v = r.get(f"auc_{n}", r.get(f"accepted_{n}"))
            tag = "" if f"auc_{n}" in r else " ok"
            cells.append(f"{_fmt(v, '.3f') + tag + ' (' + str(r[f'windows_{n}']) + ')':>14}")
        lines.append(
            f"{r['source']:<12} {r['produced_by']:<15} {r['tokens']:>6} {str(r['best']):<9} "
            f"{_fmt(r['llr_per_token'], '.3g'):>9} " + " ".join(cells)
        )
    return "\n".join(lines)
