"""A full disk under a live server's run directory (a real tmpfs, filled with a real file): the server keeps
serving what it admitted, answers new requests 507 in OpenAI's shape while /health says why, resumes on its own
once space returns, and every request it answered 200 is in the trace as read back, with no temporary file
left behind."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import make_engine
from toolkit.sampling.params import SamplingParams
from toolkit.serve.main import start_server
from toolkit.trace.reader import read_requests, read_samples

pytestmark = pytest.mark.native


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MB tmpfs of its own, 4096 files at most (root only: elsewhere the test skips with the reason)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m,nr_inodes=4096", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        reason = f"cannot mount a tmpfs to fill (needs root): {done.stderr.strip()}"
        print(f"SKIP reason: {reason}")
        pytest.skip(reason)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path) -> list[Path]:
    """Write a file until the disk refuses another byte, then create empty files until it refuses another file:
    a write that fails then fails at its first step (no temporary file is made, so none is freed that a later,
    smaller write could use). Returns what to delete to give the space back."""
    filler, made = disk / "filler", []
    with open(filler, "wb", buffering=0) as fh:
        for chunk in (65536, 4096, 1):  # down to the last byte
            try:
                while True:
                    fh.write(b"\0" * chunk)
            except OSError:
                pass
    try:
        while True:
            made.append(disk / f"inode-{len(made)}")
            made[-1].touch()
    except OSError:
        made.pop()
    return [filler, *made]


def until(condition, seconds: float) -> float:
    """Seconds until `condition()` holds (polled), or AssertionError past `seconds`."""
    t0 = time.perf_counter()
    while not condition():
        assert time.perf_counter() - t0 < seconds, f"not within {seconds} s"
        time.sleep(0.02)
    return time.perf_counter() - t0


def test_a_full_disk_is_survived_and_no_served_row_is_lost(tiny, small_disk):
    run_dir = small_disk / "run"
    srv = start_server(make_engine(tiny, sampling=SamplingParams(), max_num_seqs=4), run_dir, flush_every_steps=1)
    url, served = srv.url + "/v1/completions", {}

    def complete(name: str, max_tokens: int) -> httpx.Response:
        r = httpx.post(
            url,
            json={"prompt": f"Request {name}", "max_tokens": max_tokens, "ignore_eos": True, "seed": len(served)},
            timeout=120,
        )
        if r.status_code == 200:
            served[r.json()["id"]] = r.json()["usage"]["completion_tokens"]
        return r

    try:
        assert all(complete(f"before {i}", 8).status_code == 200 for i in range(3))
        running = threading.Thread(target=complete, args=("across the fault", 1500))
        running.start()  # admitted before the disk fills: it must finish, its rows held until they can be written
        until(lambda: srv.loop.writer.rows_written > 3 * 8 + 16, 30)  # some of its rows are on disk
        fillers = fill(small_disk)  # its next sample parts are refused
        until(lambda: srv.loop.record.unavailable is not None, 30)
        refused = complete("while full", 4)
        assert refused.status_code == 507 and int(refused.headers["retry-after"]) >= 1
        error = refused.json()["error"]
        assert error["code"] == "insufficient_storage" and "No space left on device" in error["message"], error
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "degraded"
        assert "No space left on device" in health.json()["error"]
        running.join(120)
        assert len(served) == 4  # the request admitted before the fault was answered 200
        for path in fillers:  # space returns: serving and tracing resume on their own
            path.unlink()
        recovered = until(lambda: httpx.get(srv.url + "/health").status_code == 200, 5)
        assert complete("after", 8).status_code == 200
        print(f"healthy again {recovered:.2f} s after the space returned")
    finally:
        srv.stop()
    requests = read_requests(run_dir).to_pylist()
    rows = read_samples(run_dir).to_pylist()
    ids = {r["request_id"] for r in requests}
    for response_id, tokens in served.items():  # every request answered 200 is in the trace, every token
        request_id = f"{response_id}-0"
        assert request_id in ids
        assert sum(r["request_id"] == request_id and r["token_id"] >= 0 for r in rows) == tokens, response_id
    assert not [p for p in run_dir.rglob("*.tmp")], "a temporary file was left behind"
    assert srv.loop.writer.faults > 0 and srv.loop.writer.fault is None


def test_past_max_trace_gb_new_requests_get_507(tiny, tmp_path):
    srv = start_server(
        make_engine(tiny, sampling=SamplingParams()), tmp_path / "run", flush_every_steps=1, max_trace_gb=1e-6
    )  # about a kilobyte: the first request's part files pass it
    try:
        first = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 8}, timeout=60)
        assert first.status_code == 200
        until(lambda: srv.loop.record.unavailable is not None, 10)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 8}, timeout=60)
        assert r.status_code == 507 and "past serve.max_trace_gb (1,073 bytes)" in r.json()["error"]["message"]
        assert httpx.get(srv.url + "/health").json()["status"] == "degraded"
    finally:
        srv.stop()


def test_an_idle_server_has_its_last_steps_on_disk(tiny, tmp_path):
    """Rows go to disk every serve.flush_every_steps steps; the last few steps' rows and request rows stayed in
    memory for as long as the server then idled (a kill then lost them). Once the engine has nothing to run they
    are written: a replay of the run directory read while the server still runs has every row."""
    import pyarrow.parquet as pq

    run = tmp_path / "run"
    srv = start_server(make_engine(tiny, sampling=SamplingParams()), run, flush_every_steps=64)
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 5, "n": 2}, timeout=60)
        assert r.status_code == 200

        def rows_on_disk() -> int:
            return sum(pq.read_table(p).num_rows for p in (run / "samples.parquet").glob("part-*.parquet"))

        until(lambda: rows_on_disk() == 10, 10)
        assert srv.loop.engine.has_unfinished() is False
    finally:
        srv.stop()
