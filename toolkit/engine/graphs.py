"""Decode steps in batch buckets over static buffers, captured as CUDA graphs (engine.cuda_graphs).

A step whose every chunk is one sampled decode token runs as a bucket: the smallest batch size B >= D of
BATCH_BUCKETS (capped at max_num_seqs) and the smallest key width of WIDTH_BUCKETS blocks that covers its longest
context (capped at a sequence's most blocks). Its inputs are views of one buffer allocated once per bucket, filled
by one copy a step (built whole on the host, padding rows included: one transfer, where a buffer each was five and
more), and the forward reads only those, so its shapes never change. Rows [D, B) are padding: token 0 at position 0, its
K/V written into a scratch block that no sequence owns (the cache has one block more than the block manager
hands out), attending to that one key. Each real row's table is padded with the scratch block and its keys past
its context are masked (the sdpa path) or never read (the native kernel reads each query's own context).

- `auto`: on CUDA each bucket's forward is captured once, on first use, and replayed (one launch a step instead
  of hundreds); elsewhere, and for steps with prefill chunks or speculation, the eager path runs.
- `eager`: the same buckets, buffers and padding, run without capture on any device: what CI tests on the CPU
  (a padded bucket gives each real row the bits it gets unpadded where the step's kernels are row-independent,
  as in engine.batch_invariant=true).
- `off`: the runner's own packing every step.
FlexAttention steps (attention_backend=flex) always take the runner's packing.
"""

from __future__ import annotations

import bisect
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from toolkit.devices import copy_into
from toolkit.engine.scheduler import ScheduledBatch
from toolkit.kv.attention import AttentionMetadata, additive_bias
from toolkit.kv.paged_cache import PagedKVCache
from toolkit.native.schedules import MatmulSchedule

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
WIDTH_BUCKETS = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)  # key blocks a row may attend to


def bucket_of(n: int, buckets: tuple[int, ...], cap: int) -> int:
    """The smallest bucket >= n, at most `cap` (then `cap` itself)."""
    i = bisect.bisect_left(buckets, n)
    return min(buckets[i] if i < len(buckets) else cap, cap)


@dataclass
class Bucket:
    """One (batch, width) bucket's static buffers, its captured graph and its output (when captured)."""

    inputs_F: torch.Tensor  # a step's inputs, flat: [ids B | positions B | slots B | contexts B | tables B*W]
    rows_B: torch.Tensor  # 0..B-1: every row is a logits row
    graph: torch.cuda.CUDAGraph | None = None
    logits_BV: torch.Tensor | None = None

    def __post_init__(self):
        b = self.rows_B.shape[0]
        self.input_ids_B, self.positions_B, self.slots_B, self.ctx_B = self.inputs_F[: 4 * b].view(4, b).unbind(0)
        self.tables_BW = self.inputs_F[4 * b :].view(b, -1)


class DecodeGraphs:
    """The runner's decode steps in buckets: `applies` says which steps, `run` runs one (see the module doc)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: PagedKVCache,
        backend: str,
        native_matmul: bool,
        max_num_seqs: int,
        max_model_len: int,
        capture: bool,
        schedule: MatmulSchedule | None = None,
        batch_invariant: bool = False,
    ):
        self.model, self.kv_cache, self.backend, self.native_matmul = model, kv_cache, backend, native_matmul
        self.batch_invariant = batch_invariant  # the engine's mode, which the forward keeps (PagedDecoder.forward)
        self.schedule = schedule  # the native CPU matmul's loops per rows (the runner's)
        self.device = kv_cache.layers[0][0].device
        self.block_size = kv_cache.block_size
        self.scratch = kv_cache.num_blocks - 1  # the block no sequence owns
        self.max_batch = max_num_seqs
        # a sequence's most blocks: a context past the largest width bucket gets a bucket this wide, never one as
        # wide as the pool (a 60,000-block pool's 256-row bucket was a 117 MiB table a step, 3,750 splits a token)
        self.max_width = max(1, min(self.scratch, -(-max_model_len // self.block_size)))
        self.capture = capture
        self.buckets: dict[tuple[int, int], Bucket] = {}
        self.pool = None  # the captured graphs' shared memory pool
        self.replays = 0  # steps run as a bucket (captured or not)
        self.filled: dict[tuple[int, int], int] = {}  # bucket -> rows holding a real sequence's data now

    def applies(self, batch: ScheduledBatch, num_layers: int | None) -> bool:
        return (
            num_layers is None
            and 0 < len(batch.chunks) <= self.max_batch
            and all(c.num_tokens == 1 and c.num_logits == 1 and c.samples for c in batch.chunks)
        )

    def run(self, batch: ScheduledBatch, fed_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
        """The step's logits (D, V), rows in the batch's chunk order, and the host's seconds in the forward.
        `fed_ids`: the rows' tokens on the device (async scheduling), in place of the chunks' placeholders."""
        chunks = batch.chunks
        d, bs = len(chunks), self.block_size
        width = bucket_of(max(-(-c.context_len // bs) for c in chunks), WIDTH_BUCKETS, self.max_width)
        b = bucket_of(d, BATCH_BUCKETS, self.max_batch)
        s = self.buckets.get((b, width))
        if s is None:
            s = self.buckets[b, width] = self._allocate(b, width)
        self.filled[b, width] = d  # rows [d, b) are padding again: never a freed sequence's slots
        copy_into(s.inputs_F, self._host_inputs(chunks, b, width))
        if fed_ids is not None:  # the tokens where they were sampled, not the chunks' placeholders
            s.input_ids_B[:d].copy_(fed_ids)
        self.replays += 1
        t = time.perf_counter()
        if self.capture and s.graph is None:
            try:
                self._capture(s)
            except RuntimeError as exc:  # a forward a graph cannot hold: the same buckets, eagerly, from now on
                self.capture = False
                print(
                    f"warning: CUDA graph capture failed, decode buckets run eagerly: {str(exc).splitlines()[0]}",
                    file=sys.stderr,
                )
        if s.graph is not None:
            s.graph.replay()
            logits = s.logits_BV[:d].clone()
        else:
            logits = self._forward(s)[:d]
        # no wait for the device here: the sampler's kernels queue behind the forward's (on a GPU the seconds are
        # the host's, as on the packed path)
        return logits, time.perf_counter() - t

    def _allocate(self, b: int, width: int) -> Bucket:
        """A bucket's buffers, every row padding."""
        return Bucket(
            inputs_F=self._host_inputs((), b, width).to(self.device),
            rows_B=torch.arange(b, dtype=torch.int64, device=self.device),
        )

    def _host_inputs(self, chunks, b: int, width: int) -> torch.Tensor:
        """A step's inputs as Bucket.inputs_F holds them, on the host: the chunks' rows, then padding rows (token 0 at
        position 0, writing and reading the scratch block). One list, converted once: a numpy store an element took
        half as long again at 32 rows."""
        d, bs, scratch = len(chunks), self.block_size, self.scratch
        pad = b - d
        ids, positions, ctx, tables = [], [], [], []
        for c in chunks:
            p = c.start_pos
            n = p + len(c.token_ids)  # its context_len
            used = -(-n // bs)
            ids.append(c.token_ids[0])
            positions.append(p)
            ctx.append(n)
            tables += c.block_table[:used]
            tables += (scratch,) * (width - used)
        slots = [tables[r * width + p // bs] * bs + p % bs for r, p in enumerate(positions)]
        flat = ids + [0] * pad + positions + [0] * pad + slots + [scratch * bs] * pad + ctx + [1] * pad
        flat += tables
        flat += (scratch,) * (pad * width)
        return torch.from_numpy(np.array(flat, dtype=np.int64))

    def _forward(self, s: Bucket) -> torch.Tensor:
        """The bucket's forward over its buffers alone (what a graph captures)."""
        b, width = s.tables_BW.shape
        kernel = self.backend == "kernel"
        bias = None
        if not kernel:
            keys = torch.arange(width * self.block_size, device=self.device)
            bias = additive_bias(keys[None, :] < s.ctx_B[:, None], self.model.embed.dtype)
        attn = AttentionMetadata(
            slot_mapping_N=s.slots_B,
            num_decodes=b,
            kernel_rows=b if kernel else 0,
            block_tables_SB=s.tables_BW if kernel else None,
            query_table_N=s.rows_B if kernel else None,
            query_ctx_N=s.ctx_B if kernel else None,
            decode_block_tables_DB=None if kernel else s.tables_BW,
            decode_bias_DT=bias,
            decode_ctx_D=None if kernel else s.ctx_B,
            prefills=(),
            kv_quant=self.kv_cache.quant,
        )
        return self.model(
            s.input_ids_B,
            s.positions_B,
            attn,
            self.kv_cache.layers,
            s.rows_B,
            None,
            native_matmul=self.native_matmul,
            schedule=self.schedule,
            batch_invariant=self.batch_invariant,
        )

    def _capture(self, s: Bucket) -> None:
        """Capture the bucket's forward (after two warm-up runs on a side stream, as torch's docs ask). Its
        buffers hold this step's rows already: the warm-ups write their K/V where the replay writes it again."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(s)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            s.logits_BV = self._forward(s)
        self.pool = graph.pool()
        s.graph = graph
