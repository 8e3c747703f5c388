"""Decode steps in batch buckets over static buffers, captured as CUDA graphs (engine.cuda_graphs).

A step whose every chunk is one sampled decode token runs as a bucket: the smallest batch size B >= D of
BATCH_BUCKETS (capped at max_num_seqs) and the smallest key width of WIDTH_BUCKETS blocks that covers its longest
context (capped at a sequence's most blocks). Its inputs are copied into buffers allocated once per bucket, and
the forward reads only those, so its shapes never change. Rows [D, B) are padding: token 0 at position 0, its
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

    input_ids_B: torch.Tensor
    positions_B: torch.Tensor
    slots_B: torch.Tensor
    ctx_B: torch.Tensor
    tables_BW: torch.Tensor
    rows_B: torch.Tensor  # 0..B-1: every row is a logits row
    graph: torch.cuda.CUDAGraph | None = None
    logits_BV: torch.Tensor | None = None


class DecodeGraphs:
    """The runner's decode steps in buckets: `applies` says which steps, `run` runs one (see the module doc)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: PagedKVCache,
        backend: str,
        native_matmul: bool,
        max_num_seqs: int,
        capture: bool,
        schedule: MatmulSchedule | None = None,
    ):
        self.model, self.kv_cache, self.backend, self.native_matmul = model, kv_cache, backend, native_matmul
        self.schedule = schedule  # the native CPU matmul's loops per rows (the runner's)
        self.device = kv_cache.layers[0][0].device
        self.block_size = kv_cache.block_size
        self.scratch = kv_cache.num_blocks - 1  # the block no sequence owns
        self.max_batch = max_num_seqs
        self.max_width = max(1, self.scratch)
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
        stale = self.filled.get((b, width), 0)
        if stale > d:  # rows an earlier step filled are padding again: never a freed sequence's slots
            pad = self._allocate(stale - d, width)
            for buffer, values in zip(self._inputs(s), self._inputs(pad)):
                buffer[d:stale].copy_(values)
        self.filled[b, width] = d
        # the real rows' data, built on the host
        used = [-(-c.context_len // bs) for c in chunks]
        tables = torch.tensor(
            [list(c.block_table[:n]) + [self.scratch] * (width - n) for c, n in zip(chunks, used)], dtype=torch.int64
        )
        positions = torch.tensor([c.start_pos for c in chunks], dtype=torch.int64)
        slots = tables[torch.arange(d), positions // bs] * bs + positions % bs
        rows = ([c.token_ids[0] for c in chunks], positions, slots, [c.context_len for c in chunks], tables)
        buffers = self._inputs(s)
        if fed_ids is not None:  # the tokens where they were sampled, not the chunks' placeholders
            buffers[0][:d].copy_(fed_ids)
            buffers, rows = buffers[1:], rows[1:]
        for buffer, values in zip(buffers, rows):
            copy_into(buffer[:d], torch.as_tensor(values, dtype=torch.int64))
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
        """A bucket's buffers, every row padding: token 0 at position 0, writing and reading the scratch block."""

        def full(shape, value):
            return torch.full(shape, value, dtype=torch.int64, device=self.device)

        return Bucket(
            input_ids_B=full((b,), 0),
            positions_B=full((b,), 0),
            slots_B=full((b,), self.scratch * self.block_size),
            ctx_B=full((b,), 1),
            tables_BW=full((b, width), self.scratch),
            rows_B=torch.arange(b, dtype=torch.int64, device=self.device),
        )

    @staticmethod
    def _inputs(s: Bucket) -> tuple[torch.Tensor, ...]:
        """The buffers a step fills, in the order run() builds their rows."""
        return s.input_ids_B, s.positions_B, s.slots_B, s.ctx_B, s.tables_BW

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
