"""report.html: built from a real SmolLM2 run and checked in a real browser (Debian's chromium, driven by
Playwright): every request's token count, the values a hovered token shows, the colour toggle, the two-run view's
first divergence and cause on a deliberately changed replay, no network, and a 100,000-row run's size.

Run as a script to save the README's screenshots: python tests/test_report.py <report.html> <out prefix> [views]
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import toolkit.report as report_module
from tests.conftest import make_engine, native_only, once
from toolkit.report import report_after, write_report
from toolkit.runs.session import record
from toolkit.sampling.params import SamplingParams
from toolkit.trace.diverge import first_divergences, sequences
from toolkit.trace.reader import read_requests, read_samples
from toolkit.trace.writer import write_requests

pytestmark = pytest.mark.native

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("TOOLKIT_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
ENGINE_CFG = {"max_num_batched_tokens": 64, "max_num_seqs": 8, "num_kv_blocks": 256}
REQUESTS = [
    {
        "prompt": "The capital of France is",
        "request_id": "greedy",
        "sampling_params": SamplingParams(temperature=0.0, max_tokens=10, logprobs=3, ignore_eos=True),
    },
    {
        "prompt": "Write a haiku about the sea.",
        "request_id": "nucleus",
        "sampling_params": SamplingParams(temperature=0.8, top_p=0.9, max_tokens=14, logprobs=5, seed=7),
    },
    {
        "prompt": "List three colours:",
        "request_id": "topk_rep",
        "arrival_step": 2,
        "sampling_params": SamplingParams(
            temperature=0.9, top_k=20, repetition_penalty=1.1, max_tokens=12, seed=3, logprobs=4, ignore_eos=True
        ),
    },
    {
        "prompt": "Count: one, two,",
        "request_id": "stopped",
        "sampling_params": SamplingParams(temperature=1.0, max_tokens=16, stop=[","], seed=11),
    },
]


def _browser_reason() -> str:
    import importlib.util

    if importlib.util.find_spec("playwright") is None:
        return "playwright is not installed (pip install -e '.[dev]')"
    if not CHROMIUM:
        return (
            "no chromium on PATH: `make test` installs Debian's chromium as root (.ci/toolchains); "
            "or set TOOLKIT_CHROMIUM=<browser binary>"
        )
    return ""


BROWSER_MISSING = _browser_reason()
needs_browser = pytest.mark.skipif(bool(BROWSER_MISSING), reason=BROWSER_MISSING or "-")


@pytest.fixture(scope="module")
def real_run(smollm2, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("report") / "run"
    engine = make_engine(smollm2, **ENGINE_CFG)
    ids = [engine.add_request(**r) for r in REQUESTS]
    record(engine, ids, run_dir, {"engine": ENGINE_CFG, "sampling": {}})
    return run_dir


@pytest.fixture(scope="module")
def browser():
    if BROWSER_MISSING:
        pytest.skip(BROWSER_MISSING)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


def open_report(browser, path: Path, timeout_ms: int = 60_000):
    """The page, loaded and drawn; every request it tries to make and every script error are recorded."""
    page = browser.new_page(viewport={"width": 1500, "height": 950})
    page.requests_made, page.errors = [], []
    page.on("request", lambda r: page.requests_made.append(r.url))
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    page.goto(path.resolve().as_uri())
    page.wait_for_selector("body[data-ready='1']", timeout=timeout_ms)
    return page


def f32(x) -> np.float32:
    return np.float32(x)


def test_first_divergence_names_the_changed_field_and_its_cause(real_run):
    """Property over the real trace: change one row's field family; the first divergence is that sequence, that
    position, and the cause the family points to (the forward's digest first, then the kept set, the noise...)."""
    seqs = sequences(read_samples(real_run).to_pylist())
    keys = sorted(seqs)
    assert first_divergences(seqs, seqs) == []

    def nudge(r):  # a later stage of the pipeline, changed as a change upstream would change it
        return {
            "token_id": r["token_id"] + 1,
            "noise": (r["noise"] if r["noise"] == r["noise"] else 0.0) + 1e-12,
            "raw_logprob": float(np.nextafter(f32(r["raw_logprob"]), f32(0))),
            "processed_logprob": float(np.nextafter(f32(r["processed_logprob"]), f32(0))),
        }

    # each change also moves everything downstream of it, as a real one does: the cause is the most upstream
    changes = {
        "logits": lambda r: {
            **r,
            **nudge(r),
            "logits_sha256": "0" * 64,
            "kept_sha256": "f" * 64,
            "support_size": r["support_size"] - 1,
        },
        "support": lambda r: {**r, **nudge(r), "kept_sha256": "f" * 64, "support_size": r["support_size"] - 1},
        "noise": lambda r: {**r, **nudge(r)},
        "token": lambda r: {**r, "token_id": r["token_id"] + 1, "raw_logprob": nudge(r)["raw_logprob"]},
        "logprob": lambda r: {**r, "raw_logprob": nudge(r)["raw_logprob"]},
        "finish": lambda r: {**r, "finish_reason": "abort"},
    }

    @settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.sampled_from(keys), st.data(), st.sampled_from(sorted(changes) + ["length"]))
    def check(key, data, kind):
        rows = seqs[key]
        k = data.draw(st.integers(0, len(rows) - 1))
        changed = dict(seqs)
        changed[key] = rows[:k] if kind == "length" else rows[:k] + [changes[kind](rows[k])] + rows[k + 1 :]
        (d,) = first_divergences(seqs, changed)
        assert (d.request_id, d.stream, d.position, d.index, d.kind) == (*key, rows[k]["position"], k, kind)
        assert d.token_index == (k if kind in ("logits", "support", "noise", "token") else None)

    check()


@needs_browser
def test_every_request_renders_its_tokens_and_a_hovered_token_shows_its_trace_values(real_run, browser, tmp_path):
    report = write_report(real_run)
    samples = sequences(read_samples(real_run).to_pylist())
    page = open_report(browser, report)
    rows = page.locator("#req-table tr.req")
    assert rows.count() == len(read_requests(real_run)) == len(REQUESTS)
    for i in range(rows.count()):
        rows.nth(i).click()
        name = page.locator("#request-title").inner_text()
        trace = samples[(name, 0)]
        tokens = page.locator("#strip .tok")
        assert tokens.count() == len(trace), name
        for k in sorted({0, len(trace) // 2, len(trace) - 1}):
            tokens.nth(k).hover()
            detail = page.locator("#detail")
            value = lambda field: detail.locator(f"[data-field={field}]").get_attribute("data-value")  # noqa: E731
            r = trace[k]
            assert f32(float(value("raw"))) == f32(r["raw_logprob"]), (name, k)
            assert f32(float(value("proc"))) == f32(r["processed_logprob"]), (name, k)
            assert int(value("token")) == r["token_id"] and int(value("position")) == r["position"]
            assert int(value("step")) == r["step"] and int(value("batch")) == r["batch_size"]
            assert int(value("support")) == r["support_size"]
            if math.isnan(r["noise"]):
                assert value("noise") == ""
            else:
                assert float(value("noise")) == r["noise"]  # float64, exactly
            assert value("processors") == " → ".join(r["processors"])
            shown = {
                int(t)
                for t in detail.page.locator(".alternatives tr[data-token]").evaluate_all(
                    "rows => rows.map(r => r.dataset.token)"
                )
            }
            assert shown == {e["token_id"] for e in (r["top_raw"] or []) + (r["top_processed"] or [])}
    rows.nth(0).click()  # greedy: 10 tokens
    tokens.nth(1).click()  # a click pins the details: hovering elsewhere leaves them
    pinned = page.locator("#detail [data-field=position]").get_attribute("data-value")
    tokens.nth(0).hover()
    assert page.locator("#detail [data-field=position]").get_attribute("data-value") == pinned
    page.keyboard.press("ArrowRight")  # the arrow keys move the pin along the strip
    assert int(page.locator("#detail [data-field=position]").get_attribute("data-value")) == int(pinned) + 1
    page.screenshot(path=str(tmp_path / "requests.png"))
    for view in ("engine", "summary"):
        page.click(f"#tabs button[data-view={view}]")
        page.wait_for_timeout(300)
        page.screenshot(path=str(tmp_path / f"{view}.png"))
    assert page.locator("#timeline .main-svg").count() > 0  # Plotly drew the engine timeline
    assert (
        page.locator("#manifest [data-key=weights_sha256]").inner_text()
        == __import__("json").loads((real_run / "manifest.json").read_text())["weights_sha256"]
    )
    assert page.errors == []
    assert all(u.startswith("file:") or u.startswith("data:") or u.startswith("blob:") for u in page.requests_made), (
        page.requests_made
    )  # no network: everything is inlined
    assert (tmp_path / "requests.png").stat().st_size > 10_000


@needs_browser
def test_the_colour_toggle_colours_by_processed_probability(real_run, browser):
    page = open_report(browser, write_report(real_run))
    page.locator("#req-table tr.req[data-index='1']").click()  # nucleus: top_p changes the probabilities
    trace = sequences(read_samples(real_run).to_pylist())[("nucleus", 0)]
    hue = lambda style: int(re.search(r"hsl\((\d+)", style).group(1))  # noqa: E731
    styles = lambda: page.locator("#strip .tok").evaluate_all("s => s.map(t => t.getAttribute('style'))")  # noqa: E731
    assert [hue(s) for s in styles()] == [round(120 * math.exp(r["raw_logprob"])) for r in trace]
    page.locator("input[value=proc]").check()
    assert [hue(s) for s in styles()] == [round(120 * math.exp(r["processed_logprob"])) for r in trace]


def _expected_first(a: Path, b: Path) -> dict[tuple[str, int], int]:
    """Independently of the report: each sequence's first position whose token or logits digest differ."""

    def rows(run):
        out = {}
        for r in read_samples(run).to_pylist():
            out.setdefault((r["request_id"], r["stream"]), {})[r["position"]] = (r["token_id"], r["logits_sha256"])
        return out

    ra, rb = rows(a), rows(b)
    first = {}
    for key in ra:
        for p in sorted(set(ra[key]) | set(rb.get(key, {}))):
            if ra[key].get(p) != rb.get(key, {}).get(p):
                first[key] = p
                break
    return first


@needs_browser
def test_the_two_run_view_names_the_first_divergence_of_a_changed_replay(real_run, browser, tmp_path):
    """mode=replay with int8 KV: the replay writes report.html (recorded vs replayed); its table lists exactly
    the sequences that part, at the right position, with the numerical cause, and the strips mark that token."""
    out = tmp_path / "replay"
    done = subprocess.run(
        [
            sys.executable,
            "run.py",
            "mode=replay",
            f"replay.trace={real_run}",
            "replay.overrides=['engine.kv_cache_dtype=int8']",
            "replay.allow_mismatch=true",
            f"hydra.run.dir={out}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 1, done.stdout + done.stderr  # int8 KV changes logits: the replay diverges
    assert "see it:" in done.stdout and (out / "report.html").exists()
    expected = _expected_first(real_run, out)
    assert expected, "the int8 replay should diverge"
    page = open_report(browser, out / "report.html")
    table = page.locator("#div-table tr.req")
    shown = {
        (table.nth(i).get_attribute("data-request"), int(table.nth(i).get_attribute("data-stream"))): (
            int(table.nth(i).get_attribute("data-position")),
            table.nth(i).get_attribute("data-kind"),
        )
        for i in range(table.count())
    }
    assert {k: p for k, (p, _) in shown.items()} == expected
    assert {kind for _, kind in shown.values()} == {"logits"}
    trace = sequences(read_samples(real_run).to_pylist())
    for i in range(table.count()):
        table.nth(i).click()
        key = (table.nth(i).get_attribute("data-request"), int(table.nth(i).get_attribute("data-stream")))
        cause = page.locator("#div-cause")
        assert cause.get_attribute("data-kind") == "logits" and "numerical" in cause.inner_text()
        index = [r["position"] for r in trace[key]].index(expected[key])
        assert page.locator("#strip-a .tok.first-div").get_attribute("data-i") == str(index)
        a_tokens = [r["token_id"] for r in trace[key]]
        b_tokens = [r["token_id"] for r in sequences(read_samples(out).to_pylist())[key]]
        differ = next((i for i, (x, y) in enumerate(zip(a_tokens, b_tokens)) if x != y), "")
        assert page.locator("#token-divergence").get_attribute("data-index") == str(differ)
        assert page.locator("#strip-b .tok.first-div").get_attribute("data-i") == str(index)
    assert page.locator("#compare-summary").inner_text().startswith(f"{len(expected)} of {len(trace)} sequences")
    page.screenshot(path=str(tmp_path / "compare.png"))
    assert page.errors == []


@needs_browser
@native_only  # "the logits agree" across the two runs' batch mixes: the kernels' batch-independent rows
def test_a_sampling_change_is_named_noise_or_support(real_run, browser, tmp_path, smollm2):
    """Run B: the same requests, one with another seed, one with top_k 5: the logits agree at the first
    divergence, so the causes are the noise and the kept set."""
    changed = [dict(r) for r in REQUESTS]
    changed[1]["sampling_params"] = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=14, logprobs=5, seed=8)
    changed[2]["sampling_params"] = SamplingParams(
        temperature=0.9, top_k=5, repetition_penalty=1.1, max_tokens=12, seed=3, logprobs=4, ignore_eos=True
    )
    engine = make_engine(smollm2, **ENGINE_CFG)
    ids = [engine.add_request(**r) for r in changed]
    record(engine, ids, tmp_path / "b", {"engine": ENGINE_CFG, "sampling": {}})
    report = write_report(real_run, tmp_path / "b", tmp_path / "ab.html")
    page = open_report(browser, report)
    kinds = {
        r: page.locator(f"#div-table tr.req[data-request='{r}']").get_attribute("data-kind")
        for r in ("nucleus", "topk_rep")
    }
    assert kinds == {"nucleus": "noise", "topk_rep": "support"}
    assert page.locator("#div-table tr.req[data-request='greedy']").count() == 0  # unchanged: no divergence
    assert page.errors == []


def _large_run(src: Path, dst: Path, requests: int = 1000, rows_each: int = 100) -> int:
    """A 100,000-row trace made of the real run's rows (ids and positions renumbered): the report's scale, not
    the engine's, is what is tested here."""
    shutil.copytree(src, dst)
    samples = read_samples(src).to_pylist()
    request_rows = read_requests(src).to_pylist()
    rng = np.random.default_rng(0)
    out, reqs = [], []
    for i in range(requests):
        rid = f"req-{i:04d}"
        for k in range(rows_each):
            r = dict(samples[(i + k) % len(samples)])
            # values as varied as a real run's (repeated rows would compress far better than real ones)
            lps = np.sort(-rng.exponential(2.0, 6).astype(np.float32))[::-1]
            ids = rng.integers(0, 49152, 6)
            top = [{"token_id": int(t), "logprob": float(v)} for t, v in zip(ids[1:], lps[1:])]
            r.update(
                request_id=rid,
                stream=0,
                position=100 + k,
                step=k + i // 8,
                token_id=int(ids[0]),
                raw_logprob=float(lps[0]),
                processed_logprob=float(lps[0] * 0.9),
                noise=float(rng.gumbel()),
                logits_sha256=rng.bytes(32).hex(),
                support_size=int(rng.integers(1, 49152)),
                top_raw=top,
                top_processed=[{**e, "logprob": e["logprob"] * 0.9} for e in top],
                t_emit_s=float(rng.uniform(0, 600)),
                finish_reason="length" if k == rows_each - 1 else None,
            )
            out.append(r)
        spelled = [r["token_id"] for r in out[-rows_each:]]  # what its request row records: the trace agrees
        first = samples[i % len(samples)]  # the request whose sampling policy its rows record
        base = next(q for q in request_rows if (q["request_id"], q["stream"]) == (first["request_id"], first["stream"]))
        reqs.append(
            {**base, "request_id": rid, "stream": 0, "arrival_index": i}
            | {"output_token_ids": spelled, "finish_reason": "length", "prompt_token_ids": [1] * 100}
        )
    shutil.rmtree(dst / "samples.parquet")
    (dst / "samples.parquet").mkdir()
    schema = pq.read_table(next((src / "samples.parquet").glob("part-*.parquet"))).schema
    pq.write_table(pa.Table.from_pylist(out, schema=schema), dst / "samples.parquet" / "part-000000.parquet")
    shutil.rmtree(dst / "requests.parquet")
    (dst / "requests.open.parquet").unlink(missing_ok=True)
    write_requests(dst, reqs)
    summary = json.loads((dst / "summary.json").read_text())
    (dst / "summary.json").write_text(json.dumps({**summary, "trace_rows": len(out)}))
    return len(out)


@needs_browser
@once
def test_a_100k_row_run_gives_a_small_report_that_opens_and_pages(real_run, browser, tmp_path):
    rows = _large_run(real_run, tmp_path / "large")
    assert rows == 100_000
    report = write_report(tmp_path / "large")
    size = report.stat().st_size
    print(f"100,000-row report: {size / 2**20:.1f} MB")
    assert size < 20 * 2**20
    page = open_report(browser, report, timeout_ms=120_000)
    assert page.locator("#req-table tr.req").count() == 100  # a page of the list, not 1,000 rows
    assert "page 1 of 10" in page.locator("#page-label").inner_text()
    page.locator(".pager button", has_text="›").click()
    page.locator("#req-table tr.req[data-index='150']").click()
    assert page.locator("#request-title").inner_text() == "req-0150"
    assert page.locator("#strip .tok").count() == 100
    page.mouse.wheel(0, 5000)
    assert page.errors == []


@needs_browser
def test_an_audited_transcript_without_engine_fields_renders(real_run, browser, tmp_path):
    """A mode=audit directory holds what only the claims give: no step, batch, noise, digests or steps.parquet."""
    run = tmp_path / "audit"
    shutil.copytree(real_run, run)
    shutil.rmtree(run / "steps.parquet", ignore_errors=True)
    for part in (run / "samples.parquet").glob("part-*.parquet"):
        table = pq.read_table(part)
        rows = [
            {
                **r,
                "step": None,
                "batch_size": None,
                "step_tokens": None,
                "noise": None,
                "logits_sha256": None,
                "kept_sha256": None,
                "t_emit_s": None,
                "support_size": None,
            }
            for r in table.to_pylist()
        ]
        pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), part)
    page = open_report(browser, write_report(run))
    page.locator("#strip .tok").nth(0).hover()
    assert page.locator("#detail [data-field=step]").inner_text() == "–"
    page.click("#tabs button[data-view=engine]")
    assert "no steps" in page.locator("#view-engine").inner_text()
    assert page.errors == []


@needs_browser
def test_speculation_grammar_and_parallel_samples_show_their_fields(tiny, browser, tmp_path):
    """A run with n-gram speculation, a JSON grammar and n=2: every token of every sequence hovers without a
    script error, and the detail shows the grammar / speculation fields the trace holds for it."""
    from toolkit.config import EngineConfig, SpeculativeConfig
    from toolkit.engine.core import Engine

    engine = Engine(
        tiny,
        EngineConfig(**ENGINE_CFG),
        SamplingParams(temperature=0.0),
        SpeculativeConfig(method="ngram", num_speculative_tokens=3),
    )
    ids = [
        engine.add_request(
            prompt="a b c a b c a b",
            request_id="spec",
            sampling_params=SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        ),
        engine.add_request(
            prompt="JSON:",
            request_id="json",
            sampling_params=SamplingParams(
                temperature=0.7, max_tokens=10, seed=1, structured_outputs={"json": {"type": "object"}}
            ),
        ),
        engine.add_request(
            prompt="Two:",
            request_id="pair",
            sampling_params=SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=2, ignore_eos=True),
        ),
    ]
    record(engine, ids, tmp_path / "run", {"engine": ENGINE_CFG, "sampling": {}})
    seqs = sequences(read_samples(tmp_path / "run").to_pylist())
    page = open_report(browser, write_report(tmp_path / "run"))
    names = page.locator("#req-table tr.req td:first-child").all_inner_texts()
    assert sorted(names) == sorted(f"{r}#{s}" if s else r for r, s in seqs)
    for i, name in enumerate(names):
        page.locator(f"#req-table tr.req[data-index='{i}']").click()
        request, _, stream = name.partition("#")
        rows = seqs[(request, int(stream or 0))]
        tokens = page.locator("#strip .tok")
        assert tokens.count() == len(rows)
        for k, r in enumerate(rows):
            tokens.nth(k).hover()
            field = lambda f: page.locator(f"#detail [data-field={f}]")  # noqa: E731
            if r["grammar_allowed"] is not None:
                assert int(field("grammar").get_attribute("data-value")) == r["grammar_allowed"]
            if r["origin"] not in (None, "plain"):
                assert field("origin").get_attribute("data-value") == r["origin"]
            if r["spec_proposed"]:
                assert int(field("spec").get_attribute("data-value")) == r["spec_proposed"]
    assert any(r["origin"] == "draft_accepted" for r in seqs[("spec", 0)])  # the run did speculate
    assert page.errors == []


def test_mode_report_writes_the_page_and_refuses_bad_arguments_in_one_line(real_run, tmp_path):
    def cli(*args):
        return subprocess.run(
            [sys.executable, "run.py", "mode=report", *args, f"hydra.run.dir={tmp_path / 'h'}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )

    untraced = tmp_path / "untraced"  # a run of trace.enabled=false: its manifest, no sample rows
    untraced.mkdir()
    (untraced / "manifest.json").write_text("{}")
    ok = cli(f"report.run={real_run}", f"report.out={tmp_path / 'r.html'}")
    assert ok.returncode == 0 and (tmp_path / "r.html").exists(), ok.stderr
    html = (tmp_path / "r.html").read_text()
    assert "<script src" not in html and "<link " not in html  # nothing to fetch: scripts and styles inlined
    for args, words in (
        ((), "needs report.run"),
        ((f"report.run={tmp_path}",), "not a run directory"),
        ((f"report.run={untraced}",), "recorded with trace.enabled=false"),  # "not a run directory" misled
        ((f"report.run={real_run}", f"report.against={tmp_path / 'nope'}"), "report.against"),
    ):
        bad = cli(*args)
        assert bad.returncode == 2 and words in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1


def test_a_modes_own_report_past_its_row_bound_is_a_line_with_the_command(real_run, tmp_path, monkeypatch, capsys):
    """report.auto past AUTO_MAX_ROWS sampled tokens writes no page (a long-lived server's shutdown took minutes and
    GBs for one) and says how to write it; under the bound it writes it."""
    rows = read_samples(real_run).num_rows
    monkeypatch.setattr(report_module, "AUTO_MAX_ROWS", rows - 1)
    assert report_after(real_run, out=tmp_path / "skipped.html") is None and not (tmp_path / "skipped.html").exists()
    line = capsys.readouterr().err.strip()
    assert f"{rows} sampled tokens" in line and f"mode=report report.run={real_run}" in line and "\n" not in line
    monkeypatch.setattr(report_module, "AUTO_MAX_ROWS", rows)
    assert report_after(real_run, out=tmp_path / "written.html") == tmp_path / "written.html"


def test_a_run_that_stopped_short_or_lost_rows_says_so_or_is_refused(real_run, browser, tmp_path):
    """A hostile probe's runs: an interrupted run with a request refused and a NaN in its summary renders, and says
    first that it stopped and what was refused (it showed its figures as a whole run's, and a NaN was a traceback);
    a run whose rows were lost is refused as replay and compare refuse it (it showed them as 0 tokens); report.out
    that cannot be written is one line (a traceback)."""
    import shutil

    import pyarrow.parquet as pq

    from toolkit.errors import ConfigError
    from toolkit.report import write_report
    from toolkit.trace.reader import TraceError

    stopped = tmp_path / "stopped"
    shutil.copytree(real_run, stopped, ignore=shutil.ignore_patterns("report.html"))
    summary = json.loads((stopped / "summary.json").read_text())
    summary |= {"interrupted": True, "signal": "SIGTERM", "rejected": 1, "rejected_requests": ["too long"]}
    summary["ttft_p50_s"] = float("nan")  # Python's json writes it; JSON has no such number
    (stopped / "summary.json").write_text(json.dumps(summary))
    page = open_report(browser, write_report(stopped, tokenizer=None))
    said = page.locator("#notes p").all_inner_texts()
    assert len(said) == 2 and "interrupted (SIGTERM)" in said[0] and "1 request(s) were rejected" in said[1], said
    page.close()

    lost = tmp_path / "lost"
    shutil.copytree(real_run, lost, ignore=shutil.ignore_patterns("report.html"))
    (part,) = (lost / "samples.parquet").glob("part-*.parquet")
    rows = pq.read_table(part)
    pq.write_table(rows.slice(0, rows.num_rows - 3), part)  # a closed run's last rows gone
    with pytest.raises(TraceError, match="sample rows, but the run wrote"):
        write_report(lost, tokenizer=None)
    with pytest.raises(ConfigError, match="report.out: cannot write"):
        write_report(real_run, out=tmp_path, tokenizer=None)
    # another tokenizer's run against it: its ids were decoded with this run's tokenizer (another text, or none)
    other = tmp_path / "other"
    shutil.copytree(real_run, other, ignore=shutil.ignore_patterns("report.html"))
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps({**manifest, "tokenizer_sha256": "0" * 64}))
    with pytest.raises(ConfigError, match="ran another tokenizer than"):
        write_report(real_run, other, out=tmp_path / "two.html", tokenizer=None)


def screenshots(report: Path, prefix: str, views: list[str]) -> None:
    """Save a screenshot of each view (the README's): `python tests/test_report.py <report.html> <prefix>`."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = open_report(b, report)
        if page.locator("#strip .tok").count():
            page.locator("#strip .tok").nth(min(5, page.locator("#strip .tok").count() - 1)).hover()
        for view in views:
            page.click(f"#tabs button[data-view={view}]")
            page.wait_for_timeout(500)
            if view == "requests" and page.locator("#strip .tok").count():
                page.locator("#strip .tok").nth(min(5, page.locator("#strip .tok").count() - 1)).hover()
            page.screenshot(path=f"{prefix}-{view}.png")
        b.close()


if __name__ == "__main__":
    screenshots(Path(sys.argv[1]), sys.argv[2], sys.argv[3:] or ["requests", "engine", "summary"])


def test_a_token_id_the_tokenizer_lacks_is_shown_as_its_id(smollm2):
    """A corrupt trace's id past the vocabulary (10^12: the tokenizer's decode overflowed) is shown as its id,
    where mode=report raised a traceback; ids it has are spelled."""
    from toolkit.report.data import Pieces

    pieces = Pieces(smollm2.tokenizer)
    pieces.add([10**12, 2**40, 504])
    assert pieces.table[10**12] == "#1000000000000" and pieces.table[2**40] == f"#{2**40}"
    assert pieces.table[504] == smollm2.tokenizer.decode([504], skip_special_tokens=False)


def test_a_long_prompt_keeps_its_end_and_says_how_much_was_cut():
    """The page keeps a prompt's last characters (what the output continues); a cut start is said, where it was
    dropped without a word."""
    from toolkit.report.data import _tail

    assert _tail("short", 10) == "short"
    cut = _tail("HEAD" + "x" * 20 + "TAIL", 10)
    assert cut.endswith("xxxxxTAIL") and cut.startswith("[19 characters before] …") and "HEAD" not in cut
