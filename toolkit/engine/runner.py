"""Model runner: a ScheduledBatch becomes packed tensors, one forward, and the logits to sample.

Packing order: single-token chunks first (they form the batched decode group of the
attention), then speculative verification chunks (the newest token plus its drafts),
then multi-token prefill chunks, each contiguous. The last `num_logits` tokens of a chunk
that samples get logits rows (one, or 1 + drafts when verifying), consecutively.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from toolkit.devices import tensor_on, to_device
from toolkit.engine.graphs import DecodeGraphs
from toolkit.engine.scheduler import ScheduledBatch, ScheduledChunk
from toolkit.kv import flex
from toolkit.kv.attention import AttentionMetadata, PrefillChunk, additive_bias
from toolkit.kv.paged_cache import PagedKVCache
from toolkit.native import gpu_attention, invariant_gpu, library, schedules
from toolkit.sampling.sampler import top_k

SMALL_STEP_TOKENS = 64  # a step of at most this many tokens maps its tokens to chunks, positions and slots in Python


def _token_maps(chunks: Sequence[ScheduledChunk], bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token of `chunks` in order: its chunk's index, its position and its cache slot (block_table[pos // bs] *
    bs + pos % bs), as the tensor ops of a large step compute them."""
    chunk_of, positions, slots = [], [], []
    for j, c in enumerate(chunks):
        table = c.block_table
        for pos in range(c.start_pos, c.start_pos + c.num_tokens):
            chunk_of.append(j)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
    return (
        torch.tensor(chunk_of, dtype=torch.int64),
        torch.tensor(positions, dtype=torch.int64),
        torch.tensor(slots, dtype=torch.int64),
    )


@dataclass(frozen=True)
class ForwardInputs:
    input_ids_N: torch.Tensor
    positions_N: torch.Tensor
    attn: AttentionMetadata
    logits_rows_R: torch.Tensor
    sample_chunks: tuple[ScheduledChunk, ...]  # the chunk behind each logits row, in row order


@dataclass(frozen=True)
class ModelOutput:
    logits_RV: torch.Tensor  # raw fp32 logits of the rows to sample
    sample_chunks: tuple[ScheduledChunk, ...]
    forward_s: float = 0.0  # the model's forward alone (no packing, no block copies)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: PagedKVCache,
        device: torch.device,
        attention_backend: str = "sdpa",
        batch_invariant: bool = False,
        native_matmul: bool = False,
        matmul_schedule: str | schedules.MatmulSchedule = "auto",
        flex_compile: bool = True,
        two_forwards: bool = False,
        graphs: tuple[str, int, int] = ("off", 0, 0),
    ):
        self.model = model
        self.backend = attention_backend  # "kernel", "sdpa" or "flex" (resolved by the engine)
        self.flex_compile = flex_compile
        if batch_invariant and attention_backend != "kernel":
            raise ValueError("batch-invariant mode needs the native attention kernel")
        # every projection through the fixed-order matmul (and, as in every mode of the kernel backend,
        # every query through the fixed-order kernel): a token's bits do not depend on its neighbours
        self.batch_invariant = batch_invariant
        self.native_matmul = native_matmul or batch_invariant
        self.matmul_schedule: schedules.MatmulSchedule | None = None  # the native CPU matmul's loops per rows
        if self.native_matmul and not invariant_gpu.routes(model.embed):
            self.matmul_schedule = (  # the weights packed now, with the load, not inside the first request's step
                matmul_schedule  # already chosen for these weights (a self-draft's runner over the target's)
                if isinstance(matmul_schedule, schedules.MatmulSchedule)
                else schedules.choose(
                    matmul_schedule,
                    *model.packed_projections(),
                    batch_invariant=batch_invariant,
                    packed_for=model.packed_projections,
                )
            )
            chosen = self.matmul_schedule.other_builds()  # another build's matmul for some rows: its packing
            model.drop_packed(keep=chosen)  # those measured and not chosen are released
            for target in chosen:
                model.packed_weights(library.build_named(target))  # packed now, not inside a step
        self.groups = model.arch.num_heads // model.arch.num_kv_heads
        self.dtype = model.embed.dtype  # the compute dtype (the cache may store bf16, int8 or fp8)
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        self.num_forwards = 0
        # engine.scheduler_policy=two_forwards: a step's decodes and its prefill chunks in separate forwards
        # (the interleaving post's starting point); the logits rows come out in the fused order
        self.two_forwards = two_forwards
        # decode-only steps in padded batch buckets over static buffers, captured as CUDA graphs or run eagerly
        # ((mode, max_num_seqs, max_model_len): toolkit/engine/graphs.py); the cache holds one scratch block for the
        # padding rows
        mode, max_num_seqs, max_model_len = graphs
        self.graphs = (
            None
            if mode == "off"
            else DecodeGraphs(
                model,
                kv_cache,
                attention_backend,
                self.native_matmul,
                max_num_seqs,
                max_model_len,
                capture=mode == "capture",
                schedule=self.matmul_schedule,
                batch_invariant=batch_invariant,
            )
        )

    def prepare(self, batch: ScheduledBatch) -> ForwardInputs:
        bs = self.block_size
        singles = [c for c in batch.chunks if c.num_tokens == 1]
        verifies = [c for c in batch.chunks if c.num_tokens > 1 and c.num_logits > 1]
        multis = [c for c in batch.chunks if c.num_tokens > 1 and c.num_logits == 1]
        ordered = singles + verifies + multis
        ids: list[int] = []
        rows: list[int] = []
        sample_chunks: list[ScheduledChunk] = []
        for chunk in ordered:  # per chunk: its tokens and logits rows are whole ranges
            start = len(ids)
            ids.extend(chunk.token_ids)
            if chunk.samples:
                rows.extend(range(start + chunk.num_tokens - chunk.num_logits, start + chunk.num_tokens))
                sample_chunks.append(chunk)
        # per token, with tensor ops: its chunk, position and cache slot (block_table[pos // bs] * bs + pos % bs)
        width = max(len(c.block_table) for c in ordered)
        tables_cpu = torch.tensor(
            [list(c.block_table) + [0] * (width - len(c.block_table)) for c in ordered], dtype=torch.int64
        )  # (S, B)
        if len(ids) <= SMALL_STEP_TOKENS:  # a decode step: Python's ints beat eight tiny tensor ops (0.1-0.2 ms)
            chunk_of, positions_cpu, slots_cpu = _token_maps(ordered, bs)
        else:
            counts = torch.tensor([c.num_tokens for c in ordered], dtype=torch.int64)
            chunk_of = torch.repeat_interleave(torch.arange(len(ordered)), counts)  # (N,)
            first = torch.cumsum(counts, 0) - counts
            starts = torch.tensor([c.start_pos for c in ordered], dtype=torch.int64)
            positions_cpu = starts[chunk_of] + torch.arange(len(ids)) - first[chunk_of]
            slots_cpu = tables_cpu[chunk_of, positions_cpu // bs] * bs + positions_cpu % bs
        dev = self.device
        use_kernel = self.backend == "kernel"
        # the kernel backend runs prompt chunks through the kernel too (1.4x faster than SDPA over a
        # gathered copy in the standard bench's prefill steps, and each row's bits then do not depend
        # on how its prompt was chunked)
        kernel_rows = len(ids) if use_kernel else 0
        positions_t = to_device(positions_cpu, dev)

        tables = query_table = query_ctx = None
        if use_kernel:
            tables = to_device(tables_cpu, dev)
            query_table = to_device(chunk_of, dev)
            query_ctx = positions_t + 1

        decode_tables = decode_bias = decode_ctx = None
        if singles and self.backend == "sdpa":
            width = max(len(c.block_table) for c in singles)
            decode_tables = to_device(tables_cpu[: len(singles), :width], dev)  # (D, B): the decodes come first
            ctx = tensor_on([c.context_len for c in singles], dev, torch.int64)
            decode_bias = additive_bias(torch.arange(width * bs, device=dev)[None, :] < ctx[:, None], self.dtype)
            decode_ctx = ctx

        prefills = []
        offset = len(singles)
        sdpa_chunks = verifies + multis if self.backend == "sdpa" else []
        for chunk in sdpa_chunks:
            ctx = chunk.context_len
            table = tensor_on(chunk.block_table[: -(-ctx // bs)], dev, torch.int64)
            query_pos = torch.arange(chunk.start_pos, ctx, device=dev)
            causal = torch.arange(ctx, device=dev)[None, :] <= query_pos[:, None]  # (Q, T)
            bias = additive_bias(causal, self.dtype).repeat(self.groups, 1)  # (G*Q, T)
            prefills.append(
                PrefillChunk(
                    start=offset, end=offset + chunk.num_tokens, block_table_B=table, context_len=ctx, bias_GQT=bias
                )
            )
            offset += chunk.num_tokens

        flex_meta = None
        if self.backend == "flex":
            flex_meta = flex.build(
                [list(c.block_table[: -(-c.context_len // bs)]) for c in ordered],
                [c.num_tokens for c in ordered],
                positions_t,
                self.kv_cache.num_blocks,
                bs,
                self.model.arch.sliding_window,
                self.flex_compile,
            )
        attn = AttentionMetadata(
            slot_mapping_N=to_device(slots_cpu, dev),
            num_decodes=len(singles),
            kernel_rows=kernel_rows,
            block_tables_SB=tables,
            query_table_N=query_table,
            query_ctx_N=query_ctx,
            decode_block_tables_DB=decode_tables,
            decode_bias_DT=decode_bias,
            decode_ctx_D=decode_ctx,
            prefills=tuple(prefills),
            flex=flex_meta,
            kv_quant=self.kv_cache.quant,
        )
        return ForwardInputs(
            input_ids_N=tensor_on(ids, dev, torch.int64),
            positions_N=positions_t,
            attn=attn,
            logits_rows_R=tensor_on(rows, dev, torch.int64),
            sample_chunks=tuple(sample_chunks),
        )

    def move_blocks(self, batch: ScheduledBatch) -> None:
        """The batch's copy jobs, in the only safe order: swap out, swap in, copy-on-write."""
        cache = self.kv_cache
        cache.swap_out([c.device for c in batch.swap_out], [c.host for c in batch.swap_out])
        cache.swap_in([c.device for c in batch.swap_in], [c.host for c in batch.swap_in])
        cache.copy_blocks([c.src for c in batch.block_copies], [c.dst for c in batch.block_copies])

    def run(
        self,
        batch: ScheduledBatch,
        num_layers: int | None = None,
        beside: Callable[[Callable[[], ForwardInputs]], ForwardInputs] | None = None,
        move_blocks: bool = True,
        fed_ids: torch.Tensor | None = None,
    ) -> ModelOutput:
        """The forward of a batch. `beside` runs the packing of its inputs (Python) where the caller has work
        for the other threads meanwhile (Engine.step: the last step's trace digests, sha.ShaJob.beside).
        `move_blocks=False`: the batch's copy jobs already ran (Engine.step runs them once, so that a forward it
        retries does not copy a swapped-out block again, from a block the failed forward may have written).
        `fed_ids`: a decode batch's input tokens, one a chunk in its order, on the device (async scheduling: the
        step before's choices, never read to the host); the chunks' own token_ids are then placeholders."""
        if move_blocks:
            self.move_blocks(batch)
        if fed_ids is not None:
            if any(c.num_tokens != 1 for c in batch.chunks) or fed_ids.shape != (len(batch.chunks),):
                raise ValueError("fed_ids feeds a decode batch one token a chunk")
            return self._forward(batch, num_layers, beside, fed_ids)
        decodes = tuple(c for c in batch.chunks if c.num_tokens == 1 or c.num_logits > 1) if self.two_forwards else ()
        if decodes and len(decodes) < len(batch.chunks):
            prefills = tuple(c for c in batch.chunks if c not in decodes)
            parts = [
                self._forward(dataclasses.replace(batch, chunks=decodes, num_prefill_tokens=0), num_layers, beside),
                self._forward(dataclasses.replace(batch, chunks=prefills, num_decode_tokens=0), num_layers, beside),
            ]
            # prepare() orders decodes before prefill chunks, so these rows are in the fused forward's order
            return ModelOutput(
                logits_RV=torch.cat([p.logits_RV for p in parts]),
                sample_chunks=parts[0].sample_chunks + parts[1].sample_chunks,
                forward_s=parts[0].forward_s + parts[1].forward_s,
            )
        return self._forward(batch, num_layers, beside)

    def _forward(
        self,
        batch: ScheduledBatch,
        num_layers: int | None,
        beside: Callable[[Callable[[], ForwardInputs]], ForwardInputs] | None = None,
        fed_ids: torch.Tensor | None = None,
    ) -> ModelOutput:
        if self.graphs is not None and self.graphs.applies(batch, num_layers):
            self.num_forwards += 1
            logits, seconds = self.graphs.run(batch, fed_ids)
            return ModelOutput(logits_RV=logits, sample_chunks=batch.chunks, forward_s=seconds)
        inputs = self.prepare(batch) if beside is None else beside(lambda: self.prepare(batch))
        if fed_ids is not None:  # a decode batch: one token a chunk, in the chunks' order (prepare's singles)
            inputs = dataclasses.replace(inputs, input_ids_N=fed_ids)
        self.num_forwards += 1
        t = time.perf_counter()
        logits = self.model(
            inputs.input_ids_N,
            inputs.positions_N,
            inputs.attn,
            self.kv_cache.layers,
            inputs.logits_rows_R,
            num_layers,
            native_matmul=self.native_matmul,
            schedule=self.matmul_schedule,
            batch_invariant=self.batch_invariant,
        )
        # no wait for the device (it was here): the sampler's kernels queue behind the forward's, and on a GPU the
        # seconds are the host's, as in a bucket (graphs.py)
        return ModelOutput(logits_RV=logits, sample_chunks=inputs.sample_chunks, forward_s=time.perf_counter() - t)


def kernel_runs(model: torch.nn.Module, block_size: int) -> bool:
    """Whether the fixed-order attention kernel runs this model here: on the CPU, built (not switched off), and
    taking its shapes on its cache (a 16-bit cache: head_dim 64 or 128 only); on a CUDA GPU, Triton's, taking
    its shapes (a head_dim up to 256, no soft-capping or sliding window)."""
    if model.embed.device.type == "cuda":
        a = model.arch
        return (
            gpu_attention.supports_attention(a.head_dim, a.num_heads // a.num_kv_heads)
            and a.needs_torch_attention is None
        )
    if model.embed.device.type != "cpu" or not library.available():
        return False
    a = model.arch
    return library.native().attention_supports(
        a.num_heads, a.num_kv_heads, a.head_dim, block_size, model.embed.dtype != torch.float32
    )


def recompute_logits(
    model: torch.nn.Module, token_ids: list[int], *, batch_invariant: bool = True, block_size: int = 16
) -> torch.Tensor:
    """fp32 logits (T, V) of every position of `token_ids` (row t predicts token t + 1), from a
    fresh cache in ONE prefill through the engine's own forward. In batch-invariant mode these
    are the very bits the engine produced for each position, however it was batched or cached."""
    runner, blocks = _fresh_runner(model, len(token_ids), batch_invariant, block_size)
    n = len(token_ids)
    chunk = ScheduledChunk("recompute", tuple(token_ids), 0, tuple(range(blocks)), samples=True, num_logits=n)
    return runner.run(ScheduledBatch(step=0, chunks=(chunk,), num_decode_tokens=0, num_prefill_tokens=n)).logits_RV


def _fresh_runner(
    model: torch.nn.Module, n: int, batch_invariant: bool, block_size: int = 16
) -> tuple[ModelRunner, int]:
    """A runner over a fresh cache of `n` positions (and its blocks): on the fixed-order kernels where they run
    and `batch_invariant` asks for them, else on sdpa, as the engine would run the model."""
    layers, kv_heads, head_dim = model.kv_shape
    blocks = -(-n // block_size)
    device = model.embed.device
    if batch_invariant and not kernel_runs(model, block_size):
        batch_invariant = False  # the engine runs such a model on sdpa too (toolkit.engine.backends.attention_backend)
    cache = PagedKVCache(layers, blocks, block_size, kv_heads, head_dim, model.embed.dtype, device)
    runner = ModelRunner(model, cache, device, "kernel" if batch_invariant else "sdpa", batch_invariant=batch_invariant)
    return runner, blocks


SCORING_FORWARD = 256  # positions a scoring forward takes at least (its matmuls' rows; the server's chunk)


def prompt_logprobs(
    model: torch.nn.Module,
    token_ids: Sequence[int],
    k: int,
    stop: Callable[[], bool] | None = None,
    piece_bytes: int = 32 << 20,
) -> list | None:
    """Raw logprobs of every prompt token given the ones before it (the first has none: None) and the top `k`
    alternatives at each position (float64 log-softmax): an eval harness's loglikelihood request (echo + logprobs).
    Per position: (token id, logprob, [(id, logprob)...], the token's rank there: 1 + the tokens more likely).
    The prompt is prefilled over a fresh cache in pieces of SCORING_FORWARD positions, each piece's logits scored,
    as many rows as `piece_bytes` holds float64 rows of at a time, before the next is run (the engine's chunked
    prefill, on its fixed-order kernels where they run: then every bit is the whole prompt's in one forward, and the
    engine's own). One forward over the whole prompt held its logits whole (0.2 MB a token, 786 MB at 4,000 tokens
    of SmolLM2), and a client that left was scored to the end of it (20-90 s at 4,000 tokens on a busy server).
    `stop`: asked before each piece; once true, scoring ends and the answer is None (a server's client left, or it
    is shutting down)."""
    ids = list(token_ids)
    if stop is not None and stop():
        return None
    runner, blocks = _fresh_runner(model, len(ids), True)
    table, rows = tuple(range(blocks)), [None]
    piece = max(1, piece_bytes // (8 * model.arch.vocab_size))
    forward = max(piece, SCORING_FORWARD)
    for at in range(0, len(ids) - 1, forward):  # the last token predicts nothing: it is never run
        last, logits = min(at + forward, len(ids) - 1), None
        for start in range(at, last, piece):
            if stop is not None and stop():
                return None
            end = min(start + piece, last)
            if logits is None:
                chunk = ScheduledChunk("score", tuple(ids[at:last]), at, table, samples=True, num_logits=last - at)
                batch = ScheduledBatch(step=at, chunks=(chunk,), num_decode_tokens=0, num_prefill_tokens=last - at)
                logits = runner.run(batch).logits_RV
            rows.extend(_scored(logits[start - at : end - at], ids[start + 1 : end + 1], k))
    return rows


def _scored(logits: torch.Tensor, targets_list: list[int], k: int) -> list:
    """prompt_logprobs's rows for these logits rows and the tokens they predict."""
    logprobs = torch.log_softmax(logits.double(), -1)
    targets = tensor_on(targets_list, logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, targets)
    ranks = ((logprobs > chosen).sum(-1) + 1).tolist()
    top = top_k(logprobs, k)[1] if k else targets[:, :0]
    top_ids, top_values = top.tolist(), logprobs.gather(1, top).tolist()
    return [
        (token, value, list(zip(top_ids[i], top_values[i])), rank)
        for i, (token, value, rank) in enumerate(zip(targets_list, chosen[:, 0].tolist(), ranks))
    ]


def recompute_many(
    model: torch.nn.Module,
    sequences: list[list[int]],
    last: list[int],
    *,
    block_size: int = 16,
    max_tokens: int = 2048,
    counts: dict[str, int] | None = None,
) -> list[torch.Tensor]:
    """fp32 logits of the last `last[i]` positions of each `sequences[i]` (row t predicts token t + 1), the
    sequences packed into prefills of up to `max_tokens` computed tokens through the engine's batch-invariant
    kernels, a prompt's full blocks that several of a pack share (an RL group's samples, a common system
    prompt) computed once and read by each (plan_packs): the very bits `recompute_logits` gives each one
    alone (the audit's batched recomputation). Where the kernel does not run (not built here, or the model's
    shapes) they run one at a time on sdpa, whose bits depend on the packing. `counts` gains the tokens read
    (`tokens`) and run through the model (`computed`)."""
    counts = {} if counts is None else counts
    counts["tokens"] = counts.get("tokens", 0) + sum(map(len, sequences))
    if not kernel_runs(model, block_size):
        counts["computed"] = counts.get("computed", 0) + sum(map(len, sequences))
        return [recompute_logits(model, ids, batch_invariant=False)[len(ids) - k :] for ids, k in zip(sequences, last)]
    out: list[torch.Tensor | None] = [None] * len(sequences)
    layers, kv_heads, head_dim = model.kv_shape
    for pack in plan_packs(sequences, last, block_size, max_tokens):
        counts["computed"] = counts.get("computed", 0) + pack.computed
        cache = PagedKVCache(
            layers, pack.num_blocks, block_size, kv_heads, head_dim, model.embed.dtype, model.embed.device
        )
        runner = ModelRunner(model, cache, model.embed.device, "kernel", batch_invariant=True)
        result = runner.run(
            ScheduledBatch(step=0, chunks=tuple(pack.chunks), num_decode_tokens=0, num_prefill_tokens=pack.computed)
        )
        row = 0
        for chunk in result.sample_chunks:  # the rows come in the runner's chunk order
            out[int(chunk.seq_id)] = result.logits_RV[row : row + chunk.num_logits]
            row += chunk.num_logits
    return out  # type: ignore[return-value]


@dataclass
class Pack:
    """One prefill of recompute_many: a chunk per sequence (seq_id its index), over `num_blocks` cache blocks,
    `computed` tokens through the model (a shared block's counted once)."""

    chunks: list[ScheduledChunk]
    num_blocks: int = 0
    computed: int = 0
    shared: dict[tuple, int] = dataclasses.field(default_factory=dict)  # (parent block, its tokens) -> block

    def shared_prefix(self, ids: list[int], last: int, block_size: int) -> list[int]:
        """The blocks holding the leading full blocks of `ids` this pack computes already (only blocks before
        the first position whose logits are wanted: those rows are computed by their own chunk)."""
        table: list[int] = []
        for b in range((len(ids) - last) // block_size):
            block = self.shared.get((table[-1] if table else -1, tuple(ids[b * block_size : (b + 1) * block_size])))
            if block is None:
                break
            table.append(block)
        return table

    def add(self, index: int, ids: list[int], last: int, block_size: int, prefix: list[int]) -> None:
        """Sequence `index` as a chunk reading `prefix` (its shared_prefix in this pack) and computing the rest;
        its full blocks before the checked rows become shareable by later sequences."""
        table = list(prefix)
        shareable = (len(ids) - last) // block_size
        for b in range(len(prefix), -(-len(ids) // block_size)):
            if b < shareable:  # a later sequence with this prefix reads it
                key = (table[-1] if table else -1, tuple(ids[b * block_size : (b + 1) * block_size]))
                self.shared[key] = self.num_blocks
            table.append(self.num_blocks)
            self.num_blocks += 1
        start = len(prefix) * block_size
        self.chunks.append(
            ScheduledChunk(str(index), tuple(ids[start:]), start, tuple(table), samples=True, num_logits=last)
        )
        self.computed += len(ids) - start


def plan_packs(sequences: list[list[int]], last: list[int], block_size: int, max_tokens: int) -> list[Pack]:
    """Consecutive sequences in packs of up to `max_tokens` computed tokens (one alone when it is longer),
    each reading the full prompt blocks an earlier one in its pack computes."""
    packs: list[Pack] = []
    for i, ids in enumerate(sequences):
        pack = packs[-1] if packs else None
        prefix = pack.shared_prefix(ids, last[i], block_size) if pack is not None else []
        if pack is None or (pack.chunks and pack.computed + len(ids) - len(prefix) * block_size > max_tokens):
            pack, prefix = Pack(chunks=[]), []
            packs.append(pack)
        pack.add(i, ids, last[i], block_size, prefix)
    return packs
