"""The native kernels on every build this machine can make, and on the ones it cannot run.

- Every x86 target this CPU executes (and `generic`, `scalar`), with gcc and with clang: each kernel
  against a float64 or torch reference, and a row's bits independent of the other rows and threads.
- Builds with the same profile (lanes, FMA) give the same bits whatever the compiler or -march level;
  every FMA build's matmul gives the same bits whatever its lanes.
- Targets this CPU cannot run (x86-64-v4 on an AVX2 host) are compiled, to catch build breaks.
- aarch64: the kernels and a C test driver (tests/csrc/kernel_driver.c) cross-compiled with Debian's
  gcc-aarch64-linux-gnu and run under qemu-aarch64-static: the driver checks the bitwise properties
  there, and its outputs equal, bit for bit, those of the same driver built for x86-64-v3 with 4 lanes
  (the same profile: 4 lanes, FMA), and are within tolerance of the host's own build.
"""

from __future__ import annotations

import hashlib
import math
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.numerics import with_threads
from tests.test_attention import attention_case, dense_reference
from toolkit.models.decoder import rotate_half
from toolkit.native import cpu, library, ops, sampling_ops, sha

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "csrc" / "kernel_driver.c"
FMA_X86 = "x86-64-v3"  # the x86 level with FMA: built with 4 lanes it has aarch64's profile


def _builds() -> list[tuple[str, int | None, str]]:
    out = [(t, None, cc) for t in cpu.runnable_targets() for cc in library.compilers()]
    if FMA_X86 in cpu.runnable_targets():
        out += [(FMA_X86, 4, cc) for cc in library.compilers()]
    return out


BUILDS = _builds()
IDS = [f"{t}{'/' + str(lanes) if lanes else ''}-{cc}" for t, lanes, cc in BUILDS]


def _no_compiler_reason() -> str:
    return "neither gcc nor clang is on PATH: only the torch fallback runs here (tests/test_fallback.py)"


@pytest.fixture(scope="module", params=BUILDS or [None], ids=IDS or ["no-compiler"])
def lib(request):
    if request.param is None:
        pytest.skip(_no_compiler_reason())
    target, lanes, cc = request.param
    return library.build(target, lanes, cc)  # a build that fails here fails the test: the target is runnable


def _ulps(got: torch.Tensor, want: torch.Tensor, n: float) -> bool:
    return bool(((got.double() - want).abs() <= n * 2.0**-23 * want.abs() + 1e-30).all())


@pytest.mark.parametrize(
    "heads,block_size",
    [((9, 3, 64), 16), ((8, 2, 128), 4), ((4, 4, 64), 1), ((12, 2, 128), 32), ((4, 2, 16), 16), ((6, 3, 8), 4)],
)
def test_attention_against_float64_and_batch_independent(lib, heads, block_size):
    h, kh, d = heads
    gen = torch.Generator().manual_seed(h * 100 + d + block_size)
    q, kc, vc, tables, qt, qc = attention_case(gen, h, kh, d, block_size, [1, 17, 40, 90])
    got = ops.paged_attention_cpu(q, kc, vc, tables, qt, qc, d**-0.5, lib=lib)
    want = dense_reference(q, kc, vc, tables, qt, qc, d**-0.5)
    assert (got.double() - want).abs().max().item() < 2e-5
    serial = with_threads(1, lambda: ops.paged_attention_cpu(q, kc, vc, tables, qt, qc, d**-0.5, lib=lib))
    assert torch.equal(serial, got)
    for i in range(0, q.shape[0], 2):  # each query alone gets the bits it got in the batch
        alone = ops.paged_attention_cpu(q[i : i + 1], kc, vc, tables, qt[i : i + 1], qc[i : i + 1], d**-0.5, lib=lib)
        assert torch.equal(alone[0], got[i])


def test_int8_attention_against_the_dequantised_reference(lib):
    gen = torch.Generator().manual_seed(5)
    q, kc, vc, tables, qt, qc = attention_case(gen, 9, 3, 64, 16, [5, 33, 70])
    k8 = (kc * 40).round().clamp(-127, 127).to(torch.int8)
    v8 = (vc * 40).round().clamp(-127, 127).to(torch.int8)
    ks, vs = torch.rand(kc.shape[0], 3, generator=gen) / 20, torch.rand(vc.shape[0], 3, generator=gen) / 20
    out = torch.empty(q.shape)
    got = ops.paged_attention_cpu_q8(
        q, k8.view(torch.uint8), v8.view(torch.uint8), ks, vs, tables, qt, qc, 0.125, out, lib=lib
    )
    kd = k8.float() * ks[:, None, :, None]
    vd = v8.float() * vs[:, None, :, None]
    want = dense_reference(q, kd, vd, tables, qt, qc, 0.125)
    assert (got.double() - want).abs().max().item() < 2e-5


@pytest.mark.parametrize("m,k,n", [(1, 576, 1728), (13, 67, 181), (32, 576, 576), (7, 1536, 19)])
def test_matmul_against_float64_and_row_independent(lib, m, k, n):
    gen = torch.Generator().manual_seed(m + k + n)
    x, w = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    packed = ops.pack_weight(w, lib)
    got = ops.matmul_invariant(x, packed, lib=lib)
    want = x.double() @ w.double()
    bound = k * 2.0**-23 * (x.double().abs() @ w.double().abs())  # a sum of k rounded terms
    assert ((got.double() - want).abs() <= bound).all()
    assert torch.equal(with_threads(1, lambda: ops.matmul_invariant(x, packed, lib=lib)), got)
    for i in range(m):
        assert torch.equal(ops.matmul_invariant(x[i : i + 1], packed, lib=lib)[0], got[i])


@pytest.mark.parametrize("width", [16, 576, 581, 2048])
def test_add_rms_norm_against_float64(lib, width):
    gen = torch.Generator().manual_seed(width)
    x, r, w = (
        torch.randn(9, width, generator=gen) * 3,
        torch.randn(9, width, generator=gen),
        torch.randn(width, generator=gen),
    )
    want_x = x + r
    want = want_x.double() * torch.rsqrt(want_x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    got_x, got = ops.add_rms_norm_cpu(x, r, w, 1e-5, lib=lib)
    assert torch.equal(got_x, want_x)
    assert _ulps(got, want, 24)  # a sum of up to 2048 squares in the build's lanes
    alone = ops.add_rms_norm_cpu(want_x[4:5].clone(), None, w, 1e-5, lib=lib)[1]
    assert torch.equal(alone[0], got[4])


@pytest.mark.parametrize("width", [16, 203, 1536])
def test_silu_mul_against_float64(lib, width):
    gen = torch.Generator().manual_seed(width)
    gu = torch.randn(7, 2 * width, generator=gen) * 6
    gate, up = gu[:, :width].double(), gu[:, width:].double()
    assert _ulps(ops.silu_mul_cpu(gu, lib=lib), gate * torch.sigmoid(gate) * up, 4)


def test_logsumexp_and_argmax_against_torch(lib):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 1003, generator=gen) * 20
    x[1, [17, 900]] = 90.0  # a tie: the first index wins
    x[2, 40] = float("nan")
    x[3] = float("-inf")
    x[4, 5] = float("inf")
    assert sampling_ops.argmax_cpu(x, lib=lib) == torch.argmax(x, dim=-1).tolist()
    got, want = sampling_ops.logsumexp_cpu(x, lib=lib), torch.logsumexp(x.double(), dim=-1)
    assert got[2].isnan() and got[3] == float("-inf") and got[4] == float("inf")
    ok = [0, 1, 5]
    assert (got[ok].double() - want[ok]).abs().max().item() < 1e-5


def test_gumbel_noise_and_sampling_are_the_twins_bit_for_bit(lib):
    """The native noise equals rng.py's torch and Python twins bit for bit in every build (our own
    logarithm in single IEEE operations), and a step's sampled rows pick what the torch sampler picks,
    with the same noise, over full and truncated supports (ties to the lowest id)."""
    from toolkit.sampling import rng
    from toolkit.sampling.sampler import gumbel_choice

    vocab = 49152
    hashes = rng.token_hashes(vocab, torch.device("cpu"))
    ids = torch.randint(0, vocab, (4099,), generator=torch.Generator().manual_seed(1))
    for seed, position in ((0, 0), (2**63 - 1, 10**9), (12345, 77)):
        key = rng.row_key(seed, position, 3)
        native = sampling_ops.gumbel_noise_cpu(ids, key, lib=lib)
        assert torch.equal(native, rng.gumbel(key, hashes[ids]))
        assert all(rng.gumbel_scalar(key, int(t)) == float(g) for t, g in zip(ids[:200], native[:200]))
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, 1003, generator=gen) * 4
    x[1, 100:] = float("-inf")  # 100 finite: sampled over the listed ids
    x[2, ::2] = float("-inf")  # half finite: the masked full pass
    x[3] = float("-inf")  # nothing finite: token -1
    x[4] = x[4].round()  # ties
    x[5, 7] = float("nan")  # not finite: never chosen
    keys = [rng.row_key(9, 40 + i, i % 3) for i in range(9)]
    keys[6] = None  # a greedy row: support only
    rows = [8, 0, 1, 2, 3, 4, 5, 6, 7]  # the rows as a strided view (every other row of a wider block)
    block = torch.full((18, 1003), float("nan"))
    block[0::2] = x[rows]
    tokens, noise, support = sampling_ops.gumbel_sample_cpu(block[0::2], [keys[r] for r in rows], lib=lib)
    for i, r in enumerate(rows):
        assert support[i] == int(torch.isfinite(x[r]).sum())
        if keys[r] is None:
            assert tokens[i] == -1 and math.isnan(noise[i])
            continue
        want = gumbel_choice(x[r], keys[r])
        assert tokens[i] == want[0] and (noise[i] == want[1] or math.isnan(noise[i]) and math.isnan(want[1])), r


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize(
    "stages",
    [
        (),
        (("temperature", 0.8),),
        (("temperature", 0.8), ("top_p", 0.95)),
        (("temperature", 0.7), ("top_k", 50.0)),
        (("top_k", 1.0),),
        (("top_p", 0.999),),
        (("top_p", 0.3), ("temperature", 1.7)),
        (("temperature", 0.4), ("top_k", 300.0), ("top_p", 0.9)),
        (("top_k", 2000.0),),
        (("temperature", -0.5), ("top_k", 7.0)),
        (("temperature", float("inf")), ("top_k", 3.0)),
    ],
)
def test_fused_sampler_tail_is_the_stages_bit_for_bit(lib, stages):
    """sampling_ops.sample_tail_cpu (temperature / top-k / top-p, then support, logsumexp, Gumbel-max token and
    noise, each row in one pass) equals the stages it replaces called one after another, bit for bit:
    torch's division (the temperature processor), truncate_cpu, logsumexp_cpu and gumbel_sample_cpu.
    Rows: real-looking logits, a sparse support, a few finite ids, ties, a greedy row, a NaN, a +inf, an odd
    width. (A negative or infinite temperature is no processor's, but the kernel's own maxima must not assume a
    finite one > 0: inf / inf is a NaN the raw row does not have.)"""
    from toolkit.sampling import rng

    gen = torch.Generator().manual_seed(len(stages))
    for vocab in (1003, 4096):
        x = torch.randn(8, vocab, generator=gen) * 3
        x[1, torch.rand(vocab, generator=gen) < 0.9] = float("-inf")
        x[2, 20:] = float("-inf")
        x[3] = (x[3] * 2).round()  # ties
        x[5, 11] = float("nan")
        x[6, 5] = x[5, 12] = float("inf")  # row 5: a NaN beside a +inf (NaN wins)
        block = torch.full((8, vocab + 5), 7.0)
        block[:, :vocab] = x  # strided rows
        rows = block[:, :vocab]
        keys = [rng.row_key(3, 50 + i, i % 2) for i in range(8)]
        keys[4] = None
        got = sampling_ops.sample_tail_cpu(rows, [stages] * 8, keys, lib=lib)
        lean = sampling_ops.sample_tail_cpu(rows, [stages] * 8, keys, keep_rows=False, lib=lib, raw_logsumexp=True)
        # the raw rows' logsumexp, read by the kernel on the way: logsumexp_cpu's bits (NaN row included)
        assert torch.equal(_bits(lean.raw_logsumexp_R), _bits(sampling_ops.logsumexp_cpu(rows, lib=lib)))
        want = rows.clone()
        for name, value in stages:
            if name == "temperature":
                want = want / torch.full((8, 1), value).expand_as(want)
            else:
                want = sampling_ops.truncate_cpu(want, name, torch.full((8,), value), lib=lib)[0]
        tokens, noise, support = sampling_ops.gumbel_sample_cpu(want, keys, lib=lib)
        argmax = sampling_ops.argmax_cpu(want, lib=lib)
        tokens = [t if t >= 0 else a for t, a in zip(tokens, argmax)]  # not sampled, or nothing finite
        assert torch.equal(_bits(got.processed_RV), _bits(want)) and lean.processed_RV is None
        for result in (got, lean):
            assert result.tokens == tokens and result.support == support
            assert [float(n).hex() for n in result.noise] == [float(n).hex() for n in noise]
            assert torch.equal(_bits(result.logsumexp_R), _bits(sampling_ops.logsumexp_cpu(want, lib=lib)))
            assert torch.equal(_bits(result.picked_R), _bits(want[torch.arange(8), torch.tensor(tokens)]))


def test_rope_is_the_torch_expression_bit_for_bit(lib):
    gen = torch.Generator().manual_seed(4)
    cos, sin = torch.randn(50, 64, generator=gen), torch.randn(50, 64, generator=gen)
    fused = torch.randn(7, 9 * 64, generator=gen)
    x, pos = fused[:, : 5 * 64].view(7, 5, 64), torch.tensor([0, 3, 49, 12, 12, 7, 30])
    want = x * cos[pos].unsqueeze(1) + rotate_half(x) * sin[pos].unsqueeze(1)
    assert torch.equal(ops.rope_cpu(x, cos, sin, pos, lib=lib), want)


@pytest.mark.parametrize("method", ["lanes", "sha_ni"])
@pytest.mark.parametrize("rows,width", [(3, 1), (21, 1000), (40, 49152 // 64), (2, 14), (5, 15), (9, 16), (1, 0)])
def test_sha256_rows_are_hashlib_digests(lib, rows, width, method):
    """Both paths, with tails of one and of two padding blocks (a row of 56 bytes or more past its last
    whole block needs two), and fewer rows than there are threads times streams."""
    if method == "sha_ni" and not lib.sha_ni:
        pytest.skip("this CPU has no x86 SHA extensions: sha256_rows takes the lanes path here")
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows))
    index = [(i * 5) % rows for i in range(rows)]
    want = [hashlib.sha256(x[i].numpy().tobytes()).hexdigest() for i in index]
    for threads in (1, 2, 3):
        assert sha.sha256_rows(x, index, threads=threads, lib=lib, method=method) == want
    assert sha.sha256_rows(x, index, lib=lib) == want  # whichever "auto" picks


@pytest.mark.parametrize("method", ["lanes", "sha_ni"])
def test_sha_job_in_parts_gives_every_digest_and_each_callables_result(lib, method, capfd):
    """A ShaJob hashed in parts: each beside(fn) runs fn once, on the calling thread, and returns its value
    while the other threads hash slices of the rows (rows of 20 KB: several slices a row, and a tail that
    needs two padding blocks); digests() then hashes the rest. Whatever was hashed beside which call, the
    digests are hashlib's. An exception from fn is raised after the call, with no traceback printed."""
    if method == "sha_ni" and not lib.sha_ni:
        pytest.skip("this CPU has no x86 SHA extensions: sha256_rows takes the lanes path here")
    x = torch.randn(37, 5000, generator=torch.Generator().manual_seed(37))
    index = [(i * 5) % 37 for i in range(37)] + [3]
    want = [hashlib.sha256(x[i].numpy().tobytes()).hexdigest() for i in index]
    for threads in (1, 2, 3):
        for calls in (0, 1, 3):
            job = sha.ShaJob(x, index, threads=threads, lib=lib, method=method)
            ran = []
            for k in range(calls):  # a short sleep: the other threads get some slices done meanwhile
                assert job.beside(lambda: ran.append(threading.get_ident()) or time.sleep(0.002) or k) == k
            assert ran == [threading.get_ident()] * calls
            assert job.digests() == want and job.digests() == want
    job = sha.ShaJob(x, index, threads=2, lib=lib, method=method)
    with pytest.raises(ZeroDivisionError):
        job.beside(lambda: 1 / 0)
    assert job.digests() == want
    assert "Traceback" not in capfd.readouterr().err


def test_sha_job_calls_from_two_threads_take_turns(lib):
    """digests() from another thread while beside(fn) runs waits for it (a group is never hashed by two calls
    at once: a finishing call that skipped a group another call held would leave its digests unwritten);
    digests() from inside fn is refused with a clear error rather than hanging."""
    x = torch.randn(40, 20000, generator=torch.Generator().manual_seed(40))
    want = [hashlib.sha256(x[i].numpy().tobytes()).hexdigest() for i in range(40)]
    for method in ["lanes", "lanes", "lanes"] + (["sha_ni"] if lib.sha_ni else []):  # a race: three tries
        job = sha.ShaJob(x, threads=2, lib=lib, method=method)
        seen = []
        other = threading.Thread(target=lambda: seen.append(job.digests()))

        def fn():
            other.start()
            time.sleep(0.02)  # the other thread asks for the digests while this call's worker hashes
            return "done"

        assert job.beside(fn) == "done"
        other.join()
        assert seen == [want] and job.digests() == want
        inner = sha.ShaJob(x, threads=2, lib=lib, method=method)
        with pytest.raises(RuntimeError, match="inside its own fn"):
            inner.beside(inner.digests)
        assert inner.digests() == want


# ----------------------------------------------------------------------------- across builds


def _fingerprint(lib) -> dict[str, torch.Tensor]:
    """Every kernel's output on fixed inputs."""
    gen = torch.Generator().manual_seed(11)
    q, kc, vc, tables, qt, qc = attention_case(gen, 9, 3, 64, 16, [9, 40])
    x, w = torch.randn(5, 576, generator=gen), torch.randn(576, 200, generator=gen)
    rows, norm_w = torch.randn(4, 581, generator=gen), torch.randn(581, generator=gen)
    gu, logits = torch.randn(4, 406, generator=gen) * 5, torch.randn(3, 1003, generator=gen) * 10
    return {
        "attention": ops.paged_attention_cpu(q, kc, vc, tables, qt, qc, 0.125, lib=lib),
        "matmul": ops.matmul_invariant(x, ops.pack_weight(w, lib), lib=lib),
        "rms_norm": ops.add_rms_norm_cpu(rows.clone(), None, norm_w, 1e-5, lib=lib)[1],
        "silu_mul": ops.silu_mul_cpu(gu, lib=lib),
        "logsumexp": sampling_ops.logsumexp_cpu(logits, lib=lib),
    }


def _all_builds():
    if not BUILDS:
        pytest.skip(_no_compiler_reason())
    return [library.build(t, lanes, cc) for t, lanes, cc in BUILDS]


def test_builds_with_one_profile_give_the_same_bits():
    """The bits depend on (lanes, FMA) only: not on the compiler, nor on the -march level."""
    groups: dict[str, list] = {}
    for lib in _all_builds():
        groups.setdefault(lib.profile.numerics, []).append(lib)
    compared = 0
    for libs in groups.values():
        first = _fingerprint(libs[0])
        for other in libs[1:]:
            got = _fingerprint(other)
            for name in first:
                assert torch.equal(first[name], got[name]), (name, libs[0].profile, other.profile)
            compared += 1
    assert compared > 0 or len(BUILDS) < 2


def test_every_fma_build_gives_the_matmul_the_same_bits():
    """One FMA chain per output element: the lanes only split the columns."""
    fma = [lib for lib in _all_builds() if lib.profile.fma]
    if len({lib.profile.lanes for lib in fma}) < 2:
        pytest.skip("fewer than two FMA builds of different lanes run on this CPU")
    outs = [_fingerprint(lib)["matmul"] for lib in fma]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_targets_this_cpu_cannot_run_still_compile():
    machine = cpu.machine()
    others = [t for t, (arch, _) in cpu.TARGETS.items() if arch == machine and t not in cpu.runnable_targets()]
    if not others:
        pytest.skip(f"this CPU ({cpu.host_target()}) runs every {machine} target: nothing compile-only")
    if not library.compilers():
        pytest.skip(_no_compiler_reason())
    for target in others:
        for cc in library.compilers():
            assert library.compile_only(target, cc=cc).exists()


# ----------------------------------------------------------------------------- aarch64 under qemu


def _driver_flags(target: str, lanes: int | None) -> list[str]:
    return [
        *library.BASE_FLAGS,
        *cpu.TARGETS[target][1],
        *([f"-DTOOLKIT_VL={lanes}"] if lanes else []),
        "-fopenmp",
        f"-I{library.CSRC}",
    ]


def _run_driver(cc: str, flags: list[str], tmp: Path, name: str, runner: list[str]) -> dict[str, bytes]:
    exe, out = tmp / name, tmp / f"{name}-out"
    out.mkdir()
    build = subprocess.run(
        [cc, *flags, *map(str, sorted(library.CSRC.glob("*.c"))), str(DRIVER), "-o", str(exe), "-lm"],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    run = subprocess.run([*runner, str(exe), str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr
    return {p.stem: p.read_bytes() for p in out.glob("*.bin")}


def _cross_tools() -> tuple[str, str]:
    cc, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64-static")
    if not (cc and qemu):
        pytest.skip(
            "aarch64 cross-check needs Debian's gcc-aarch64-linux-gnu and qemu-user-static "
            "(make test installs them where apt-get runs as root: .ci/toolchains)"
        )
    return cc, qemu


def test_aarch64_kernels_under_qemu_match_the_host(tmp_path):
    cc, qemu = _cross_tools()
    host_target = cpu.host_target()
    with ThreadPoolExecutor(3) as pool:  # the three builds and runs are independent: side by side on the cores
        arm_job = pool.submit(_run_driver, cc, [*_driver_flags("armv8-a", None), "-static"], tmp_path, "arm", [qemu])
        same_job = (
            pool.submit(_run_driver, "gcc", _driver_flags(FMA_X86, 4), tmp_path, "x86_4", [])
            if FMA_X86 in cpu.runnable_targets() and shutil.which("gcc")
            else None
        )
        host_job = (
            pool.submit(_run_driver, "gcc", _driver_flags(host_target, None), tmp_path, "host", [])
            if host_target in cpu.TARGETS and shutil.which("gcc")
            else None
        )
        arm = arm_job.result()
    assert len(arm) >= 10
    if same_job is not None:
        same_profile = same_job.result()
        for name, data in arm.items():  # NEON (4 lanes, FMA) and AVX2 at 4 lanes with FMA: the same bits
            assert data == same_profile[name], name
    if host_job is not None:
        host = host_job.result()
        for name in (
            "sha256",
            "argmax",
            "rope",
            "rms_norm_x",
            "sha256_data",
            "gumbel_noise",
            "gumbel_tokens",
            "gumbel_chosen_noise",
            "gumbel_support",
            "tail_support",
            "round_bf16",
            "round_f16",
        ):
            assert arm[name] == host[name], name  # exact in every build
        for name in (
            "matmul",
            "attention_h9_d64",
            "attention_h8_d128",
            "attention_h4_d16",
            "attention_q8_h6_d64",
            "rms_norm",
            "silu_mul",
            "logsumexp",
        ):
            a, b = np.frombuffer(arm[name], np.float32), np.frombuffer(host[name], np.float32)
            assert np.allclose(a, b, rtol=2e-5, atol=2e-5), (name, np.abs(a - b).max())


def test_aarch64_build_with_clang_compiles():
    if not shutil.which("clang"):
        pytest.skip("clang is not installed (make test installs it where apt-get runs as root: .ci/toolchains)")
    flags = [*library.BASE_FLAGS, "--target=aarch64-linux-gnu", "-march=armv8-a", "-c", "-o", "/dev/null"]
    sources = sorted(library.CSRC.glob("*.c"))
    with ThreadPoolExecutor(2) as pool:
        results = pool.map(
            lambda src: subprocess.run(["clang", *flags, str(src)], capture_output=True, text=True), sources
        )
        for src, result in zip(sources, results):
            assert result.returncode == 0, (src.name, result.stderr[-1500:])
