"""The engine on a GPU (engine.device=cuda) in fp32, bf16 and fp16: skipped, with the reason printed, where
torch sees no CUDA device (CI and the 2-core machines); run where one is lent, `pytest tests/test_cuda.py`.

What must hold there as on the CPU: a run repeated gives the same tokens and logits bits (what replay relies
on), the cache gives the logits a no-cache recompute gives (within the format's rounding: cuBLAS picks its
summation order by shape), and the GPU's fp32 logits are the CPU's within fp32 rounding."""

from __future__ import annotations

import pytest
import torch

from toolkit.config import EngineConfig, ModelConfig
from toolkit.engine.core import Engine
from toolkit.engine.runner import recompute_logits
from toolkit.models import load_model
from toolkit.sampling.params import SamplingParams

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA device here (torch.cuda.is_available() is False)"
    ),
    pytest.mark.native,
]  # the CPU runs of the GPU comparisons ask toolkit.native
MODEL = dict(
    name="tiny",
    seed=3,
    vocab_size=512,
    num_layers=2,
    hidden_size=256,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=512,
)
# the largest |logprob| difference between the cached run and the no-cache recompute, per format
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.15, "float16": 0.02}


def requests(vocab: int = 512):
    return [
        dict(
            prompt_token_ids=[(31 * i + 7 * j) % vocab for j in range(5 + 9 * i)],
            request_id=f"r{i}",
            arrival_step=i,
            sampling_params=SamplingParams(temperature=[0.0, 1.0][i % 2], seed=i, max_tokens=12, ignore_eos=True),
        )
        for i in range(5)
    ]


def run(loaded, device: str, **engine) -> tuple[Engine, dict[str, dict[int, torch.Tensor]]]:
    """Run requests() (over the model's vocabulary) to the end; each request's logits rows by position."""
    eng = Engine(
        loaded,
        EngineConfig(device=device, max_num_batched_tokens=16, max_num_seqs=4, block_size=4, **engine),
        SamplingParams(),
    )
    for r in requests(loaded.arch.vocab_size):
        eng.add_request(**r)
    rows: dict[str, dict[int, torch.Tensor]] = {}
    while eng.has_unfinished():
        out = eng.step()
        for s in out.samples:
            rows.setdefault(s.request_id, {})[s.position] = out.logits_RV[s.logits_row].float().cpu()
    return eng, rows


@pytest.fixture(scope="module", params=["float32", "bfloat16", "float16"])
def on_gpu(request):
    return load_model(ModelConfig(**MODEL, dtype=request.param), device="cuda")


def test_a_repeated_run_gives_the_same_bits(on_gpu):
    first_engine, first = run(on_gpu, "cuda")
    second_engine, second = run(on_gpu, "cuda")
    # Triton's paged attention (toolkit/native/invariant_gpu.py), cuBLAS for the projections
    assert first_engine.attention_backend == "kernel" and first_engine.matmul_backend == "torch"
    for rid in first:
        assert first_engine.requests[rid].token_ids == second_engine.requests[rid].token_ids
        for p in first[rid]:
            assert torch.equal(first[rid][p], second[rid][p]), (rid, p)


def test_cached_logits_are_the_recomputed_ones(on_gpu):
    engine, rows = run(on_gpu, "cuda")
    worst = 0.0
    for rid, by_pos in rows.items():
        tokens = engine.requests[rid].token_ids
        recomputed = recompute_logits(on_gpu.model, tokens[:-1], batch_invariant=False).float().cpu()
        for p, logits in by_pos.items():
            worst = max(worst, (recomputed[p - 1].log_softmax(-1) - logits.log_softmax(-1)).abs().max().item())
    assert worst <= TOLERANCE[str(on_gpu.model.embed.dtype).removeprefix("torch.")], worst


def test_fp32_on_the_gpu_is_the_cpu_within_rounding():
    gpu_engine, gpu = run(load_model(ModelConfig(**MODEL), device="cuda"), "cuda")
    cpu_engine, cpu = run(load_model(ModelConfig(**MODEL)), "cpu")
    for rid, by_pos in cpu.items():
        greedy = rid in ("r0", "r2", "r4")
        if greedy:  # sampled requests may part on a near tie; greedy ones on these logits do not
            assert gpu_engine.requests[rid].token_ids == cpu_engine.requests[rid].token_ids, rid
        for p in set(by_pos) & set(gpu[rid]):
            if gpu_engine.requests[rid].token_ids[:p] == cpu_engine.requests[rid].token_ids[:p]:
                assert (by_pos[p] - gpu[rid][p]).abs().max() < 1e-3, (rid, p)


def test_async_scheduling_gives_every_row_its_bits_on_the_gpu(on_gpu):
    """engine.async_scheduling on a GPU (decode steps captured as graphs, each step's choices fed to the next
    forward where they were sampled, the host's copies non-blocking): with no row to drop (no stop), the steps it
    queues are the engine's own, so every row's logits are the same bits as without it, and every token the same."""
    eng, rows = run(on_gpu, "cuda")
    eng_async, rows_async = run(on_gpu, "cuda", async_scheduling=True)
    assert rows_async.keys() == rows.keys()
    for request_id, by_position in rows.items():
        assert by_position.keys() == rows_async[request_id].keys()
        for position, logits in by_position.items():
            assert torch.equal(rows_async[request_id][position], logits), (request_id, position)
        assert eng_async.output(request_id).outputs[0].token_ids == eng.output(request_id).outputs[0].token_ids


def test_the_noise_and_the_batched_choice_on_the_gpu_are_the_cpus_bit_for_bit():
    """The counter-based noise is integer mixing plus correctly rounded double operations, one torch kernel each:
    the GPU's noise is the CPU's, and the GPU's batched Gumbel-max (every row in one pass) picks the tokens, with
    the noise bits, that the CPU's row-by-row code picks, over full, truncated and empty supports."""
    from toolkit.sampling import rng
    from toolkit.sampling.sampler import gumbel_choices

    vocab, cpu, gpu = 49152, torch.device("cpu"), torch.device("cuda")
    keys = [
        rng.row_key(seed, position, stream)
        for seed, position, stream in (
            (0, 0, 0),
            (2**63 - 1, 10**9, 3),
            (12345, 77, 1),
            (7, 5, 2),
            (99, 1, 0),
            (3, 3, 3),
        )
    ]
    on_cpu = rng.gumbel_rows(rng.key_words(keys, cpu), rng.token_hashes(vocab, cpu))
    on_gpu = rng.gumbel_rows(rng.key_words(keys, gpu), rng.token_hashes(vocab, gpu)).cpu()
    assert torch.equal(on_cpu.view(torch.int64), on_gpu.view(torch.int64))
    x = torch.randn(len(keys), vocab, generator=torch.Generator().manual_seed(5)) * 4
    x[1, 100:] = float("-inf")
    x[2, ::2] = float("-inf")
    x[3] = float("-inf")
    x[4] = x[4].round()
    x[5, 7] = float("nan")
    want_tokens, want_noise = gumbel_choices(x, keys, batched=False)
    got_tokens, got_noise = gumbel_choices(x.to(gpu), keys)
    assert got_tokens == want_tokens
    assert [float(g).hex() for g in got_noise] == [float(g).hex() for g in want_noise]


def test_the_gpus_read_once_sample_is_the_cpus(monkeypatch):
    """sample() on a GPU computes every field there and reads them in one transfer: the tokens, noise, supports
    and kept-set digests are the CPU torch path's bit for bit, the log-probabilities and alternatives within fp32
    rounding (the GPU's logsumexp is its own kernel), over raw and processed rows, greedy and sampled."""
    from toolkit.sampling import sampler

    gen = torch.Generator().manual_seed(9)
    raw = torch.randn(6, 4099, generator=gen) * 3
    raw[5, 3] = float("nan")
    proc = raw / 0.7
    proc[1, 100:] = float("-inf")
    proc[2, ::2] = float("-inf")
    proc[3] = float("-inf")
    rows = [sampler.SampleRow(greedy=i % 3 == 0, seed=i, position=10 + i, stream=0, num_top=i % 4) for i in range(6)]
    for processed in (raw, proc):
        monkeypatch.setattr(sampler, "gumbel_sample_cpu", lambda *a, **k: None)
        monkeypatch.setattr(sampler, "argmax_cpu", lambda *a, **k: None)
        want = sampler.sample(raw, processed, rows)
        raw_gpu = raw.cuda()
        got = sampler.sample(raw_gpu, raw_gpu if processed is raw else processed.cuda(), rows)
        assert got.token_ids == want.token_ids and got.support_sizes == want.support_sizes
        assert [float(g).hex() for g in got.noise] == [float(g).hex() for g in want.noise]
        assert got.kept_sha256 == want.kept_sha256
        for a, b in ((got.raw_logprobs, want.raw_logprobs), (got.processed_logprobs, want.processed_logprobs)):
            assert all(x == y or abs(x - y) <= 1e-5 or (x != x and y != y) for x, y in zip(a, b))
        assert [[t for t, _ in row] for row in got.top_processed] == [[t for t, _ in row] for row in want.top_processed]


def test_captured_graphs_give_the_eager_buckets_bits(on_gpu):
    """engine.cuda_graphs=auto captures each decode bucket; its replays give every row the bits that the same
    buckets give run eagerly (cuda_graphs=eager: the same kernels, the same padded shapes), and the tokens that
    the packed, unpadded path gives, its logits within the format's rounding."""
    eager_engine, eager = run(on_gpu, "cuda", cuda_graphs="eager")
    graph_engine, graphed = run(on_gpu, "cuda")
    off_engine, off = run(on_gpu, "cuda", cuda_graphs="off")
    captured = [b for b in graph_engine.runner.graphs.buckets.values() if b.graph is not None]
    assert captured and eager_engine.runner.graphs.capture is False and off_engine.runner.graphs is None
    for rid in eager:
        assert graph_engine.sequences(rid)[0].token_ids == eager_engine.sequences(rid)[0].token_ids
        for p in eager[rid]:
            assert torch.equal(graphed[rid][p], eager[rid][p]), (rid, p)
            assert (graphed[rid][p].log_softmax(-1) - off[rid][p].log_softmax(-1)).abs().max() < TOLERANCE[
                str(on_gpu.model.embed.dtype).removeprefix("torch.")
            ], (rid, p)


@pytest.mark.parametrize("dtype,invariant", [("float32", False), ("bfloat16", False), ("bfloat16", True)])
def test_a_gpu_run_replays_bit_for_bit_and_verifies(tmp_path, dtype, invariant):
    """python run.py engine.device=cuda (CUDA graphs on): mode=replay reproduces every traced row, mode=verify
    finds the cached logits the recomputed ones. Batch-invariant (issue 57): the replay under another token budget
    and batch size (other steps, other chunk mixes) is bit-identical, and verify.reference=exact passes."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent

    def cli(*args):
        return subprocess.run([sys.executable, "run.py", *args], cwd=root, capture_output=True, text=True, timeout=600)

    done = cli(
        "model=tiny",
        f"model.dtype={dtype}",
        "engine.device=cuda",
        f"hydra.run.dir={tmp_path / 'run'}",
        "workload.num_requests=12",
        "workload.min_tokens=4",
        "workload.max_tokens=16",
        "print_outputs=false",
        "report.auto=false",
        *(["engine.batch_invariant=true"] if invariant else []),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    other = ['replay.overrides=["engine.max_num_batched_tokens=16","engine.max_num_seqs=4"]'] if invariant else []
    replayed = cli("mode=replay", f"replay.trace={tmp_path / 'run'}", f"hydra.run.dir={tmp_path / 'replay'}", *other)
    assert replayed.returncode == 0 and replayed.stdout.strip().splitlines()[-1].startswith("bit-identical"), (
        replayed.stdout[-2000:] + replayed.stderr[-2000:]
    )
    verified = cli(
        "mode=verify",
        f"verify.trace={tmp_path / 'run'}",
        f"hydra.run.dir={tmp_path / 'verify'}",
        *(["verify.reference=exact"] if invariant else []),
    )
    assert verified.returncode == 0, verified.stdout[-2000:] + verified.stderr[-2000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_kernels_give_a_row_the_same_bits_at_every_batch_size(dtype):
    """Issue 57 on a GPU: the invariant matmul (tensor-core tile products, one tiling, no split-K), the RMSNorm and
    the logsumexp give each row the bits it gets alone, at batch 1, 7, 32 and 64, and the matmul is float64's
    product within fp32 sums' rounding. (The tl.sum matmul, what CI's interpreter checks, keeps its rows' bits
    too; on an H100 its fp32 results missed the bound by TF32's margin, so only its rows' bits are checked.)"""
    from toolkit.native import gpu_matmul as gm
    from toolkit.native import invariant_gpu as ig

    gen = torch.Generator().manual_seed(11)
    # rows over several of matmul_dot's tiles (64 rows at 16 bits, 16 at fp32)
    x = torch.randn(200, 576, generator=gen).to(dtype).cuda()
    w = (torch.randn(576, 1536, generator=gen) / 24).to(dtype).cuda()
    exact = x.double() @ w.double()
    bound = 580 * 2.0**-24 * (x.double().abs() @ w.double().abs()) + 1e-30
    for fn in (gm.matmul, gm.matmul_dot):
        full = fn(x, w)
        assert fn is gm.matmul or ((full.double() - exact).abs() <= bound).all(), fn.__name__
        for m in (1, 7, 32, 64, 130):
            assert torch.equal(fn(x[:m], w), full[:m]), (fn.__name__, m)
        for rows in ((5, 6), (130, 141), (190, 200)):
            assert torch.equal(fn(x[slice(*rows)], w), full[slice(*rows)]), (fn.__name__, rows)
    norm = ig.rms_norm(x, w[:, 0].abs() + 0.5, 1e-5)
    lse = ig.logsumexp(x @ w)
    for m in (1, 7, 32):
        assert torch.equal(ig.rms_norm(x[:m], w[:, 0].abs() + 0.5, 1e-5), norm[:m])
        assert torch.equal(ig.logsumexp((x @ w)[:m].contiguous()), lse[:m])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_weights_storage_order_keeps_the_invariant_matmuls_bits_on_a_gpu(dtype):
    """The weights stored (N, K), which the benchmark times beside the engine's (K, N) (gpu_matmul.layout_tilings):
    on a GPU the tile product reads its operand from shared memory in another layout, and must give the same bits,
    at 1 and 32 rows, in every tiling the benchmark times in that order."""
    from toolkit.native import gpu_matmul as gm

    gen = torch.Generator().manual_seed(12)
    x = torch.randn(32, 2048, generator=gen).to(dtype).cuda()
    w = (torch.randn(2048, 1000, generator=gen) / 45).to(dtype).cuda()
    w_nk = gm.stored_nk(w)
    assert w_nk.stride() == (1, 2048)
    for blocks in gm.layout_tilings(dtype):
        for m in (1, 32):
            got = gm.matmul_dot(x[:m], w_nk, blocks, out_dtype=dtype)
            assert torch.equal(got, gm.matmul_dot(x[:m], w, blocks, out_dtype=dtype)), (blocks, m)


@pytest.mark.parametrize("graphs", ["off", "auto"])
def test_an_engine_whose_weights_are_stored_n_by_k_gives_every_row_its_bits_on_a_gpu(graphs):
    """`gpu_matmul.store_weights_nk`, what `python -m toolkit.bench.gpu --weights-nk` times: the batch-invariant
    engine's tokens and logits rows are the bits it gives over the weights as loaded, CUDA graphs off and on."""
    from toolkit.native import gpu_matmul as gm

    as_loaded = load_model(ModelConfig(**MODEL, dtype="bfloat16"), device="cuda")
    stored_nk = load_model(ModelConfig(**MODEL, dtype="bfloat16"), device="cuda")
    gm.store_weights_nk(stored_nk.model)
    w = stored_nk.model.layers[0].w_down
    assert w.stride() == (1, w.shape[0]) and stored_nk.model.lm_head_t.stride()[0] == 1  # moved, as the bench does
    want_eng, want = run(as_loaded, "cuda", batch_invariant=True, cuda_graphs=graphs)
    got_eng, got = run(stored_nk, "cuda", batch_invariant=True, cuda_graphs=graphs)
    assert got.keys() == want.keys()
    for request_id, rows in want.items():
        assert got_eng.sequences(request_id)[0].token_ids == want_eng.sequences(request_id)[0].token_ids
        assert rows.keys() == got[request_id].keys()
        for position, logits in rows.items():
            assert torch.equal(got[request_id][position], logits), (request_id, position)


def test_a_long_contexts_split_attention_keeps_a_tokens_bits_in_any_batch():
    """Issue 57's KV split on a GPU: contexts up to 3,000 keys (12 splits of 256, combined in order) give each token
    the bits it gets alone, beside 31 others or with wider tables (more splits allocated), within bf16's rounding
    of float64; a context of one split is the unsplit kernel's, bit for bit."""
    from toolkit.native import gpu_attention as ga

    gen = torch.Generator().manual_seed(5)
    n, kv_heads, groups, dim, block, width = 32, 2, 4, 64, 16, 188
    k_cache, v_cache = (torch.randn(2, n * width + 1, block, kv_heads, dim, generator=gen)).to(torch.bfloat16).cuda()
    tables = torch.randperm(n * width, generator=gen).view(n, width).cuda()
    ctx = torch.randint(1, width * block + 1, (n,), generator=gen)
    ctx[:4] = torch.tensor([1, 200, 256, width * block])
    ctx = ctx.cuda()
    q = torch.randn(n, kv_heads * groups, dim, generator=gen).to(torch.bfloat16).cuda()
    rows = torch.arange(n, device="cuda")

    def attend(index, tables_SB=tables, split=ga.ATTENTION_SPLIT):
        out = torch.empty_like(q[index])
        ga.paged_attention(q[index], k_cache, v_cache, tables_SB, rows[index], ctx[index], dim**-0.5, out, split)
        return out

    everything = torch.arange(n, device="cuda")
    out = attend(everything)
    for index in ([0], [3], [3, 1], list(range(7)), list(range(31, -1, -1))):
        assert torch.equal(attend(torch.tensor(index, device="cuda")), out[index]), index
    wider = torch.cat([tables, tables[:, :40]], 1)
    assert torch.equal(attend(everything, wider), out)
    unsplit = attend(everything, split=16 * -(-width * block // 16))
    short = ctx <= ga.ATTENTION_SPLIT
    assert torch.equal(unsplit[short], out[short])
    keys = k_cache[tables].reshape(n, -1, kv_heads, dim).double()
    values = v_cache[tables].reshape(n, -1, kv_heads, dim).double()
    for i in (0, 1, 3, 17):
        c = int(ctx[i])
        for h in range(kv_heads * groups):
            weights = torch.softmax(keys[i, :c, h // groups] @ q[i, h].double() * dim**-0.5, 0)
            want = weights @ values[i, :c, h // groups]
            assert (out[i, h].double() - want).abs().max() <= 2**-7 * want.abs().max() + 1e-3, (i, h)


# each product's own tiling by its shape (gpu_matmul.DOT_BLOCKS_BY_SHAPE, as --dot-blocks-from fills it): MODEL's o,
# down and gate-and-up products in three others, q, k and v and the LM head in the format's
BY_SHAPE = {(256, 256): (16, 16, 256, 4), (512, 256): (16, 16, 512), (256, 1024): (64, 64, 64)}


@pytest.mark.parametrize("blocks", [None, (64, 16, 256, 4), BY_SHAPE])
def test_batch_invariant_rows_are_the_same_bits_in_every_batch_mix_and_graph_mode(blocks, monkeypatch):
    """Issue 57's matrix on a GPU: engine.batch_invariant=true (Triton matmul, attention, norms, logsumexp), one
    request's logits rows bit-identical alone and at batch 7, 32 and 64, its decode steps beside other requests'
    prompt chunks (they arrive while it decodes, in chunks of a small token budget), CUDA graphs on and off; in the
    matmul's own 16-bit tiling, a leading candidate the benchmark compares (`--dot-blocks`: a longer K slice four
    stages deep; the stages move loads, never the sums), and a tiling of each product's own (`--dot-blocks-from`)."""
    from toolkit.native import gpu_matmul as gm

    looked_up = set()  # the (K, N) of every product the engine's matmul asked a tiling for
    if isinstance(blocks, dict):
        monkeypatch.setattr(gm, "DOT_BLOCKS_BY_SHAPE", blocks)
        lookup = gm.dot_blocks
        monkeypatch.setattr(gm, "dot_blocks", lambda d, k=None, n=None: looked_up.add((k, n)) or lookup(d, k, n))
    elif blocks is not None:
        monkeypatch.setattr(gm, "DOT_BLOCKS", blocks)
    loaded = load_model(ModelConfig(**MODEL, dtype="bfloat16"), device="cuda")
    target = [(13 * j + 5) % 512 for j in range(21)]

    def rows_of(batch: int, graphs: str, mixed: bool) -> tuple[list[int], dict[int, torch.Tensor]]:
        eng = Engine(
            loaded,
            EngineConfig(
                device="cuda",
                batch_invariant=True,
                cuda_graphs=graphs,
                block_size=4,
                max_num_seqs=64,
                max_num_batched_tokens=64 if mixed else 4096,
            ),
            SamplingParams(),
        )
        assert eng.matmul_backend == "native" and eng.attention_backend == "kernel"
        eng.add_request(
            prompt_token_ids=target,
            request_id="t",
            arrival_step=0,
            sampling_params=SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        )
        for i in range(batch - 1):
            eng.add_request(
                prompt_token_ids=[(7 * i + 3 * j) % 512 for j in range(3 + (i * 5) % 40)],
                request_id=f"o{i}",
                arrival_step=(2 + i % 5) if mixed else 0,
                sampling_params=SamplingParams(temperature=1.0, seed=i, max_tokens=12, ignore_eos=True),
            )
        got: dict[int, torch.Tensor] = {}
        while eng.has_unfinished():
            out = eng.step()
            for i, s in enumerate(out.samples):
                if s.request_id == "t":
                    got[s.position] = out.logits_RV[i].float().cpu()
        return eng.sequences("t")[0].token_ids, got

    tokens, alone = rows_of(1, "off", False)
    for batch in (1, 7, 32, 64):
        for graphs in ("off", "auto"):
            for mixed in (False, True) if batch > 1 else (False,):
                other_tokens, rows = rows_of(batch, graphs, mixed)
                assert other_tokens == tokens, (batch, graphs, mixed)
                assert rows.keys() == alone.keys()
                for p in alone:
                    assert torch.equal(rows[p], alone[p]), (batch, graphs, mixed, p)
    assert not isinstance(blocks, dict) or set(blocks) <= looked_up  # each product's own tiling was read by its shape


@pytest.mark.parametrize(
    "dtype,cache_dtype", [(torch.bfloat16, None), (torch.float32, None), (torch.float32, torch.bfloat16)]
)
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (32, 1, 100)])
def test_rope_with_the_cache_writes_and_a_wide_or_odd_head_on_a_gpu(dtype, cache_dtype, heads, kv_heads, dim):
    """The GPU's fused RoPE and cache writes are RoPE then write_kv bit for bit (keys rounded to the cache's format as
    torch rounds them), and its attention takes a head_dim of no power of two (100) and 32 query heads a KV head
    (two programs each): float64's result within the format's rounding."""
    from tests.test_invariant_gpu import rope_write_kv_checked
    from toolkit.native import gpu_attention as ga

    gen = torch.Generator().manual_seed(dim + heads)
    n, blocks, block = 37, 8, 16
    positions = torch.arange(n, device="cuda")
    slots = torch.randperm(blocks * block, generator=gen)[:n].cuda()
    q, k_cache, v_cache = rope_write_kv_checked(
        gen, heads, kv_heads, dim, dtype, cache_dtype, positions, slots, blocks, block
    )
    tables = (slots // block)[None, :].repeat(n, 1)  # each token's keys: the blocks its slots fell in (any order)
    ctx = torch.arange(1, n + 1, device="cuda").clamp(max=tables.shape[1] * block)
    out = torch.empty_like(q)
    ga.paged_attention(q, k_cache, v_cache, tables, torch.arange(n, device="cuda"), ctx, dim**-0.5, out)
    keys = k_cache[tables[0]].reshape(-1, kv_heads, dim).double()
    values = v_cache[tables[0]].reshape(-1, kv_heads, dim).double()
    groups = heads // kv_heads
    for i in (0, 17, n - 1):
        c = int(ctx[i])
        for h in (0, heads - 1):
            weights = torch.softmax(keys[:c, h // groups] @ q[i, h].double() * dim**-0.5, 0)
            want = weights @ values[:c, h // groups]
            bound = 1e-5 if dtype == torch.float32 and cache_dtype is None else 2**-7 * want.abs().max().item() + 1e-3
            assert (out[i, h].double() - want).abs().max() <= bound, (i, h)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("granularity", ["block", "tensor"])
def test_an_8_bit_cache_runs_in_the_triton_attention_on_a_gpu(kv_cache_dtype, granularity):
    """An int8 / fp8 cache on a GPU takes the Triton attention (its scales read in the kernel; torch's sdpa before):
    a repeated run gives the same bits, and its logits are torch's sdpa path's within one 8-bit unit's effect (the
    cache writes are the same ops on both, but a key the two paths computed an fp32 rounding apart can round to
    neighbouring 8-bit units: an H200 saw 1.2e-3; a scale lost or applied twice is off by more than 1).
    Its decode buckets are captured with static tensor scales and run eagerly with running block scales
    (graph_mode). The kernel over one cache: test_the_triton_attention_over_an_8_bit_cache_is_float64s_on_a_gpu."""
    loaded = load_model(ModelConfig(**MODEL), device="cuda")
    kv = dict(kv_cache_dtype=kv_cache_dtype, kv_scale_granularity=granularity)  # buckets: eager, or captured
    engine, rows = run(loaded, "cuda", **kv)
    again_engine, again = run(loaded, "cuda", **kv)
    sdpa_engine, sdpa = run(loaded, "cuda", attention_backend="sdpa", **kv)
    assert engine.attention_backend == "kernel" and sdpa_engine.attention_backend == "sdpa"
    assert engine.graph_mode == ("capture" if granularity == "tensor" else "eager")
    for rid, by_pos in rows.items():
        assert engine.requests[rid].token_ids == again_engine.requests[rid].token_ids
        for p, logits in by_pos.items():
            assert torch.equal(logits, again[rid][p]), (rid, p)
            if engine.requests[rid].token_ids[:p] == sdpa_engine.requests[rid].token_ids[:p]:
                assert (logits.log_softmax(-1) - sdpa[rid][p].log_softmax(-1)).abs().max() < 1e-2, (rid, p)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("per_block", [True, False])
@pytest.mark.parametrize("groups,dim", [(2, 64), (20, 100)])
def test_the_triton_attention_over_an_8_bit_cache_is_float64s_on_a_gpu(kv_cache_dtype, per_block, groups, dim):
    """The attention compiled for a GPU over an int8 / fp8 cache (a scale per block and KV head, or per KV head;
    split and unsplit; 2 query heads a KV head, and 20: the 16-head programs): the float64 attention over the cache
    de-quantised within fp32 sums' rounding."""
    from tests.test_invariant_gpu import _attention_reference
    from toolkit.kv.quant import FORMATS, quantize
    from toolkit.native import gpu_attention as ga

    gen = torch.Generator().manual_seed(groups + dim)
    kv_heads, blocks, block, n = 2, 12, 8, 9
    k, v = (torch.randn(blocks, block, kv_heads, dim, generator=gen) * 2 for _ in range(2))
    axes = (1, 3) if per_block else (0, 1, 3)
    k_scales, v_scales = (x.abs().amax(dim=axes) / FORMATS[kv_cache_dtype][1] for x in (k, v))
    shape = (-1, 1, kv_heads, 1) if per_block else (1, 1, kv_heads, 1)
    k8, v8 = (quantize(x, s.view(shape), kv_cache_dtype) for x, s in ((k, k_scales), (v, v_scales)))
    k_dq, v_dq = (x8.float() * s.view(shape) for x8, s in ((k8, k_scales), (v8, v_scales)))
    tables = torch.randperm(blocks, generator=gen)[:10].view(1, 10)
    query_table = torch.zeros(n, dtype=torch.int64)
    query_ctx = torch.tensor([1, 2, 7, 8, 9, 33, 64, 79, 80])
    q = torch.randn(n, kv_heads * groups, dim, generator=gen)
    want = _attention_reference(q, k_dq, v_dq, tables, query_table, query_ctx, dim**-0.5)
    cuda = [x.cuda() for x in (q, k8, v8, tables, query_table, query_ctx)]
    for split in (16, 256):
        out = torch.empty_like(cuda[0])
        ga.paged_attention(*cuda, dim**-0.5, out, split, k_scales=k_scales.cuda(), v_scales=v_scales.cuda())
        assert (out.cpu().double() - want).abs().max() <= 1e-5, split


def test_async_scheduling_queues_the_next_step_without_waiting_for_the_gpu(on_gpu, monkeypatch):
    """With async scheduling, the lookahead (the next step's schedule and forward) and the staging of its decide
    (processors, the sampler's queued work) make no synchronising CUDA call (torch.cuda.set_sync_debug_mode: a read of
    a value, nonzero, a boolean mask's indexing, a copy from pageable memory), so the host never waits there for the
    GPU to drain: sampled requests with top-p, top-k, min-p, penalties and a logit bias, after the warm-up steps
    (the graphs' capture)."""
    import warnings

    from toolkit.engine import ahead

    watched: list[str] = []
    for name in ("_look_ahead", "_stage"):
        original = getattr(ahead.Pipeline, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    return _original(self, *args, **kwargs)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    watched.extend(
                        f"{_name} {w.filename}:{w.lineno}: {w.message}" for w in seen if "synchroniz" in str(w.message)
                    )

        monkeypatch.setattr(ahead.Pipeline, name, counted)
    eng = Engine(on_gpu, EngineConfig(device="cuda", max_num_seqs=8, async_scheduling=True), SamplingParams())
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=1),
        SamplingParams(temperature=0.7, top_k=20, min_p=0.05, repetition_penalty=1.2, seed=2, logprobs=2),
        SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3, logit_bias={5: 3.0}),
    ]
    for i, p in enumerate(params * 2):
        eng.add_request(
            prompt_token_ids=[(7 * i + j) % 512 for j in range(6)],
            sampling_params=p.replace(max_tokens=24, ignore_eos=True),
        )
    for _ in range(6):  # prefill, the first decode steps and their graphs' capture
        eng.step()
    watched.clear()
    while eng.has_unfinished():
        eng.step()
    assert eng.pipeline is not None and watched == [], watched[:5]


def test_a_packed_forward_does_not_wait_for_the_gpu(on_gpu, monkeypatch):
    """The runner's packed forward (every prefill step, and every step with engine.cuda_graphs=off) called
    torch.cuda.synchronize after each forward, so the host waited for the GPU to drain; nothing in a step's forward
    waits now (the sampler's one event, on its own copies, is the only wait)."""
    calls = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: (calls.append(a), real(*a, **k)))
    eng, rows = run(on_gpu, "cuda", cuda_graphs="off")
    assert sum(len(r) for r in rows.values()) == 5 * 12
    assert calls == []


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gpt2", "gemma2"])
def test_the_other_families_run_on_the_gpu_as_on_the_cpu(family):
    """Qwen2's q/k/v biases, Qwen3's q/k norms and heads wider than hidden / heads, GPT-2's LayerNorm, learned
    positions and unfused MLP, Gemma2's soft-capped sliding window (torch's sdpa on CUDA), with CUDA graphs on:
    fp32 logits are the CPU's within fp32 rounding and greedy tokens alike; a bf16 run repeated gives the same
    bits; in the batch-invariant mode (not Gemma2's: refused on CUDA) a request's rows are the same bits alone and
    beside six others arriving while it decodes."""
    from tests.families import checkpoint_dir

    cfg = dict(name="hf", path=str(checkpoint_dir(family)))
    gpu_engine, gpu = run(load_model(ModelConfig(**cfg), device="cuda"), "cuda")
    cpu_engine, cpu = run(load_model(ModelConfig(**cfg)), "cpu")
    for rid, by_pos in cpu.items():
        if rid in ("r0", "r2", "r4"):  # greedy
            assert gpu_engine.requests[rid].token_ids == cpu_engine.requests[rid].token_ids, rid
        for p in set(by_pos) & set(gpu[rid]):
            if gpu_engine.requests[rid].token_ids[:p] == cpu_engine.requests[rid].token_ids[:p]:
                assert (by_pos[p] - gpu[rid][p]).abs().max() < 1e-3, (rid, p)
    bf16 = load_model(ModelConfig(**cfg, dtype="bfloat16"), device="cuda")
    (_, first), (_, second) = run(bf16, "cuda"), run(bf16, "cuda")
    assert all(torch.equal(first[r][p], second[r][p]) for r in first for p in first[r])
    if bf16.arch.needs_torch_attention:
        return
    vocab = bf16.arch.vocab_size

    def target_rows(others: int) -> dict[int, torch.Tensor]:
        eng = Engine(
            bf16,
            EngineConfig(device="cuda", batch_invariant=True, block_size=4, max_num_seqs=8, max_num_batched_tokens=24),
            SamplingParams(),
        )
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        eng.add_request(
            prompt_token_ids=[(13 * j + 5) % vocab for j in range(17)], request_id="t", sampling_params=params
        )
        for i in range(others):
            prompt = [(7 * i + 3 * j) % vocab for j in range(3 + 5 * i)]
            eng.add_request(prompt_token_ids=prompt, request_id=f"o{i}", arrival_step=2 + i % 3, sampling_params=params)
        rows = {}
        while eng.has_unfinished():
            out = eng.step()
            rows |= {s.position: out.logits_RV[s.logits_row].float().cpu() for s in out.samples if s.request_id == "t"}
        return rows

    alone, beside = target_rows(0), target_rows(6)
    assert alone.keys() == beside.keys() and all(torch.equal(alone[p], beside[p]) for p in alone)
