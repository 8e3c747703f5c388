"""Sampling: Gumbel-max over the processed logits with counter-based noise.

token = argmax_i (processed_i + G_i), G_i = Gumbel noise keyed by (seed, position, stream, i),
an exact sample from softmax(processed) (the Gumbel-max trick) and a pure function of the
row's logits and its key. Greedy rows (temperature 0) take the argmax of the processed
logits; ties go to the lowest token id. Noise is evaluated only on the support, which
gives the same values as evaluating it everywhere: each token's noise depends on its id.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from toolkit import devices
from toolkit.devices import tensor_on
from toolkit.native import invariant_gpu
from toolkit.native.sampling_ops import Patches, TailCall, argmax_cpu, gumbel_sample_cpu, logprobs_at_cpu, logsumexp_cpu
from toolkit.native.sha import sha256_rows
from toolkit.sampling import rng

Tail = tuple[tuple[str, float], ...]  # a row's trailing processors the sampler applies: (name, its value) in order


@dataclass(frozen=True)
class SampleRow:
    greedy: bool
    seed: int
    position: int  # position of the token being sampled
    stream: int
    num_top: int = 0  # alternatives to record (SamplingParams.logprobs)
    purpose: int = rng.SAMPLE  # which independent noise to draw (a speculative draft uses rng.DRAFT)


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    raw_logprobs: list[float]  # log softmax(raw logits) at the token
    processed_logprobs: list[float]  # log softmax(processed logits) at the token
    support_sizes: list[int]
    noise: list[float]  # Gumbel noise of the chosen token (NaN for greedy rows)
    top_raw: list[list[tuple[int, float]]]
    top_processed: list[list[tuple[int, float]]]
    kept_sha256: list[str]  # digest of each row's kept set (see kept_digest)
    raw_logsumexp_R: torch.Tensor | None = None  # the raw rows' logsumexp the log-probabilities were taken with
    raw_logsumexp: list[float] | None = None  # the same, read to the host with the rest (DeviceSample)


def pack_kept(finite_RV: torch.Tensor) -> torch.Tensor:
    """(R, V) bool -> (R, ceil(V / 8)) uint8: bit i & 7 of byte i >> 3 is token i (the kernel's layout)."""
    r, vocab = finite_RV.shape
    padded = torch.zeros((r, (vocab + 7) // 8 * 8), dtype=torch.uint8, device=finite_RV.device)
    padded[:, :vocab] = finite_RV
    weights = tensor_on([1, 2, 4, 8, 16, 32, 64, 128], finite_RV.device, torch.uint8)
    return (padded.view(r, -1, 8) * weights).sum(-1, dtype=torch.uint8)


@functools.lru_cache(maxsize=8)
def full_kept_digest(vocab: int) -> str:
    return sha256_rows(pack_kept(torch.ones((1, vocab), dtype=torch.bool)))[0]


def kept_digests(
    support: Sequence[int], vocab: int, bits_RB: torch.Tensor | None = None, finite_RV: torch.Tensor | None = None
) -> list[str]:
    """The kept-set digest of each row: sha256 of its mask of tokens with a finite processed logit, packed
    as ceil(V / 8) bytes (token i is bit i & 7 of byte i >> 3; a trainer rebuilds the sampling mask and
    checks it against this). Rows with the whole vocabulary share one digest; the others are read from the
    kernel's `bits_RB` or packed from `finite_RV`."""
    partial = [i for i, s in enumerate(support) if s < vocab]
    out = [full_kept_digest(vocab)] * len(support)
    if not partial:
        return out
    if bits_RB is None:
        digests = sha256_rows(pack_kept(finite_RV[partial]).cpu())
    else:  # the kernel's masks, hashed in place (its lanes of rows at a time)
        digests = sha256_rows(bits_RB, partial)
    for i, d in zip(partial, digests):
        out[i] = d
    return out


def logsumexp_rows(x_RV: torch.Tensor, per_row: bool = True) -> torch.Tensor:
    """logsumexp of each row (R,). `per_row` computes one row at a time: torch's batched reduction
    can split a row differently with another number of rows, and in the batch-invariant mode a
    token's log-probability must not depend on its batch. The default mode promises no such thing
    (with torch's GEMM, SDPA or a GPU its logits depend on the batch), so it takes the batched call
    (3-4x faster at 64 rows). fp32 rows on the CPU take one C pass per row instead, batch-invariant
    and several times faster than either torch call (toolkit/native/csrc/rowwise.c); rows on a GPU one Triton
    kernel, one program a row (toolkit/native/invariant_gpu.py), batch-invariant and one launch."""
    native = logsumexp_cpu(x_RV)
    if native is not None:
        return native
    if invariant_gpu.routes(x_RV):  # one kernel, one program and order a row
        return invariant_gpu.logsumexp(x_RV)
    if x_RV.shape[0] <= 1 or not per_row:
        return torch.logsumexp(x_RV, dim=-1)
    return torch.cat([torch.logsumexp(x_RV[i : i + 1], dim=-1) for i in range(x_RV.shape[0])])


def sample(
    raw_RV: torch.Tensor,
    processed_RV: torch.Tensor,
    rows: list[SampleRow],
    raw_logsumexp_R: torch.Tensor | None = None,
    per_row: bool = True,
    tail: Sequence[Tail] | None = None,
    patches: Patches | None = None,
) -> SampleResult:
    """Choose one token per row. `processed_RV is raw_RV` (no processor changed anything) takes a fast
    path: the processed distribution is the raw one and its support is the whole vocabulary. Every
    sampled row's noise, and every processed row's support, comes from one native pass over the step
    (toolkit/native/csrc/gumbel.c); torch computes the same bits where the kernel does not run.

    `tail` (from apply_pipeline(defer_tail=True)): per row, the processors still to apply to
    `processed_RV`; they run in the same native pass, each row processed, counted and sampled while it is
    in cache, and the processed rows are written out only when top alternatives are asked for (the same
    values as the processors, then this function, one after the other). `patches` (the pipeline's, made
    before the tail) are made in that pass too, or to a copy of `processed_RV` where it does not run."""
    fused = FusedSample.of(raw_RV, processed_RV, rows, raw_logsumexp_R, per_row, tail, patches)
    if fused is not None:
        return fused.result()
    if devices.off_cpu(raw_RV):
        return device_sample(raw_RV, processed_RV, rows, raw_logsumexp_R, per_row, patches).result()
    r, vocab = raw_RV.shape
    keys = _keys(rows)
    num_top = max((row.num_top for row in rows), default=0)
    raw_lse = _raw_lse(raw_RV, raw_logsumexp_R, per_row)
    if patches is not None and patches.rows_S.numel():
        processed_RV = patches.apply(processed_RV)
    sampled = [i for i, key in enumerate(keys) if key is not None]
    unprocessed = processed_RV is raw_RV
    native = gumbel_sample_cpu(processed_RV, keys) if sampled or not unprocessed else None
    finite_RV = None
    if native is not None:
        chosen, noise, support = native
    else:
        finite_RV = None if unprocessed else torch.isfinite(processed_RV)
        support = None if unprocessed else finite_RV.sum(dim=-1).tolist()
        chosen, noise = gumbel_choices(processed_RV, keys, finite_RV)
    if unprocessed:
        support = [vocab] * r
    proc_lse = raw_lse if unprocessed else logsumexp_rows(processed_RV, per_row)
    tokens = chosen
    if len(sampled) < r or -1 in chosen:  # greedy rows, or a row without a finite logit: the argmax
        argmax = argmax_cpu(processed_RV)
        if argmax is None:
            argmax = torch.argmax(processed_RV, dim=-1).tolist()
        tokens = [t if t >= 0 else a for t, a in zip(chosen, argmax)]
    raw_lp = _logprobs_at(raw_RV, raw_lse, tokens)
    proc_lp = raw_lp if unprocessed else _logprobs_at(processed_RV, proc_lse, tokens)
    top_raw = _top(raw_RV, raw_lse, rows, num_top)
    top_proc = top_raw if unprocessed else _top(processed_RV, proc_lse, rows, num_top)
    if not unprocessed and finite_RV is None and min(support, default=vocab) < vocab:
        finite_RV = torch.isfinite(processed_RV)
    return SampleResult(
        token_ids=tokens,
        raw_logprobs=raw_lp,
        processed_logprobs=proc_lp,
        support_sizes=support,
        noise=noise,
        top_raw=top_raw,
        top_processed=top_proc,
        kept_sha256=kept_digests(support, vocab, finite_RV=finite_RV),
        raw_logsumexp_R=raw_lse,
    )


def device_sample(
    raw_RV: torch.Tensor,
    processed_RV: torch.Tensor,
    rows: list[SampleRow],
    raw_logsumexp_R: torch.Tensor | None = None,
    per_row: bool = True,
    patches: Patches | None = None,
) -> DeviceSample:
    """sample()'s work off the CPU queued, not read (DeviceSample): the same arguments, without a tail."""
    if patches is not None and patches.rows_S.numel():
        processed_RV = patches.apply(processed_RV)
    raw_lse = _raw_lse(raw_RV, raw_logsumexp_R, per_row)
    return DeviceSample(raw_RV, processed_RV, rows, _keys(rows), raw_lse, per_row)


class DeviceSample:
    """sample() off the CPU: every field computed where the logits are, in a fixed sequence of tensor operations, and
    read in one transfer. Each read is a wait for the device; the row-at-a-time fields were up to ten of them a step
    (the support, the choice and its noise, the argmax, each log-probability, each list of alternatives, the kept
    sets). The same bits as sample()'s path on the CPU (tests/test_batched_sampler.py runs it there).

    Two halves: constructing it queues the work and the fields' copies to the host (page-locked memory), then records
    an event; `result()` waits for that event alone, so work queued after it (the next step's forward, with async
    scheduling) goes on meanwhile. `tokens_R`: the choice, where the logits are, before anything is read."""

    def __init__(
        self,
        raw_RV: torch.Tensor,
        processed_RV: torch.Tensor,
        rows: list[SampleRow],
        keys: list[tuple[int, int] | None],
        raw_lse: torch.Tensor,
        per_row: bool,
    ):
        r, self.vocab = raw_RV.shape
        self.rows, self.raw_lse = rows, raw_lse
        self.unprocessed = unprocessed = processed_RV is raw_RV
        num_top = max((row.num_top for row in rows), default=0)
        finite_RV = None if unprocessed else torch.isfinite(processed_RV)
        sampled = [i for i, key in enumerate(keys) if key is not None]
        # greedy rows, and rows without a finite logit: the argmax (the first maximal id; a NaN counts as the maximum)
        argmax_R = torch.argmax(processed_RV, dim=-1)
        self.all_greedy = not sampled  # no noise to draw or read: NaN for every row, filled on the host
        noise_field = []
        if sampled:
            chosen_R = torch.full((r,), -1, dtype=torch.int64, device=raw_RV.device)
            noise_R = torch.full((r,), float("nan"), dtype=torch.float64, device=raw_RV.device)
            index = tensor_on(sampled, raw_RV.device, torch.int64)
            x_SV = processed_RV.index_select(0, index)
            finite_SV = torch.isfinite(x_SV) if finite_RV is None else finite_RV.index_select(0, index)
            words = rng.key_words([keys[i] for i in sampled], raw_RV.device)
            chosen_R[index], noise_R[index] = _batched_choice_tensors(x_SV, words, finite_SV)
            argmax_R = torch.where(chosen_R >= 0, chosen_R, argmax_R)
            noise_field.append(noise_R)
        self.tokens_R = argmax_R
        proc_lse = raw_lse if unprocessed else logsumexp_rows(processed_RV, per_row)
        at_R1 = self.tokens_R.unsqueeze(1)
        fields = [self.tokens_R, *noise_field, raw_RV.gather(1, at_R1).squeeze(1) - raw_lse, raw_lse]
        if not unprocessed:
            processed_lp = processed_RV.gather(1, at_R1).squeeze(1) - proc_lse
            fields += [processed_lp, finite_RV.sum(dim=-1), pack_kept(finite_RV)]
        self.tops = 0 if not num_top else 1 if unprocessed else 2
        for logits, lse in ((raw_RV, raw_lse), (processed_RV, proc_lse))[: self.tops]:
            values, ids = _top_k_device(logits, num_top)
            fields += [values - lse.unsqueeze(1), ids]
        self.host, self.event = queue_read(fields)

    def result(self) -> SampleResult:
        if self.event is not None:
            self.event.synchronize()
        read, rows, vocab = iter(self.host), self.rows, self.vocab
        tokens = next(read).tolist()
        noise = [float("nan")] * len(rows) if self.all_greedy else next(read).tolist()
        raw_lp, lse = next(read).tolist(), next(read).tolist()
        proc_lp, support, kept_RB = raw_lp, [vocab] * len(rows), None
        if not self.unprocessed:
            proc_lp, support, kept_RB = next(read).tolist(), next(read).tolist(), next(read)
        tops = [_top_lists(next(read).tolist(), next(read).tolist(), rows) for _ in range(self.tops)]
        top_raw = tops[0] if tops else [[] for _ in rows]
        return SampleResult(
            token_ids=tokens,
            raw_logprobs=raw_lp,
            processed_logprobs=proc_lp,
            support_sizes=support,
            noise=noise,
            top_raw=top_raw,
            top_processed=tops[-1] if tops else top_raw,
            kept_sha256=kept_digests(support, vocab, kept_RB),
            raw_logsumexp_R=self.raw_lse,
            raw_logsumexp=lse,
        )


def queue_read(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """The tensors' copies on the host, queued (CUDA tensors into page-locked memory, behind the work that computes
    them), and an event recorded after them to wait on before reading (None: CPU tensors, as they are)."""
    device = next((t.device for t in tensors if t.is_cuda), None)
    if device is None:
        return tensors, None
    host = [t.to("cpu", non_blocking=True) if t.is_cuda else t for t in tensors]
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return host, event


def read_once(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors on the host, the device waited on once (queue_read, then its event)."""
    host, event = queue_read(tensors)
    if event is not None:
        event.synchronize()
    return host


class FusedSample:
    """sample() where a tail of processors is left to it: its keys and arguments (Python), the kernel's one
    native pass over the rows on every thread (`run`), and the SampleResult (Python, `result`; it runs the
    pass first if nobody did). Apart, so that a caller can put other work beside the Python parts."""

    def __init__(
        self,
        raw_RV: torch.Tensor,
        processed_RV: torch.Tensor,
        rows: list[SampleRow],
        raw_logsumexp_R: torch.Tensor | None,
        per_row: bool,
        tail: Sequence[Tail],
        patches: Patches | None,
    ):
        self.raw_RV, self.processed_RV, self.rows, self.per_row = raw_RV, processed_RV, rows, per_row
        self.tail, self.given_lse = list(tail), raw_logsumexp_R
        self.keys = _keys(rows)
        self.num_top = max((row.num_top for row in rows), default=0)
        self.own_lse = raw_logsumexp_R is None and processed_RV is raw_RV  # not given: the kernel's, of its raw input
        self.call = TailCall.of(
            processed_RV, self.tail, self.keys, keep_rows=self.num_top > 0, patches=patches, raw_logsumexp=self.own_lse
        )

    @classmethod
    def of(
        cls,
        raw_RV: torch.Tensor,
        processed_RV: torch.Tensor,
        rows: list[SampleRow],
        raw_logsumexp_R: torch.Tensor | None = None,
        per_row: bool = True,
        tail: Sequence[Tail] | None = None,
        patches: Patches | None = None,
    ) -> FusedSample | None:
        """sample()'s fused path for these arguments, not yet run; None where sample() takes another."""
        return cls(raw_RV, processed_RV, rows, raw_logsumexp_R, per_row, tail, patches) if tail and any(tail) else None

    def run(self) -> None:
        if self.call is None:
            raise RuntimeError("a pipeline tail was left to the sampler where its kernel does not run")
        self.call.run()

    def result(self) -> SampleResult:
        self.run()
        fused, raw_RV, rows, num_top = self.call.result(), self.raw_RV, self.rows, self.num_top
        raw_lse = fused.raw_logsumexp_R if self.own_lse else _raw_lse(raw_RV, self.given_lse, self.per_row)
        tokens, proc_lse = fused.tokens, fused.logsumexp_R
        return SampleResult(
            token_ids=tokens,
            raw_logprobs=_logprobs_at(raw_RV, raw_lse, tokens),
            processed_logprobs=(fused.picked_R - proc_lse).tolist(),
            support_sizes=fused.support,
            noise=fused.noise,
            top_raw=_top(raw_RV, raw_lse, rows, num_top),
            top_processed=_top(fused.processed_RV, proc_lse, rows, num_top),
            kept_sha256=kept_digests(fused.support, raw_RV.shape[1], fused.kept_bits_RB),
            raw_logsumexp_R=raw_lse,
        )


def _keys(rows: list[SampleRow]) -> list[tuple[int, int] | None]:
    """Each row's noise key (None for greedy rows), all drawn in one call."""
    drawn = iter(rng.row_keys([(row.seed, row.position, row.stream, row.purpose) for row in rows if not row.greedy]))
    return [None if row.greedy else next(drawn) for row in rows]


def _raw_lse(raw_RV: torch.Tensor, given: torch.Tensor | None, per_row: bool) -> torch.Tensor:
    return given if given is not None else logsumexp_rows(raw_RV, per_row)


def _logprobs_at(logits_RV: torch.Tensor, lse_R: torch.Tensor, tokens: list[int]) -> list[float]:
    if (few := logprobs_at_cpu(logits_RV, lse_R, tokens)) is not None:  # a few CPU rows: no torch call
        return few
    token_t = tensor_on(tokens, logits_RV.device, torch.int64).unsqueeze(1)
    return (logits_RV.gather(1, token_t).squeeze(1) - lse_R).tolist()


NOISE_ELEMENTS_PER_PASS = 1 << 22  # rows x vocabulary a pass evaluates: each float64 / int64 temporary <= 32 MiB


def gumbel_choices(
    logits_RV: torch.Tensor,
    keys: Sequence[tuple[int, int] | None],
    finite_RV: torch.Tensor | None = None,
    batched: bool | None = None,
) -> tuple[list[int], list[float]]:
    """gumbel_choice of every row under its key (None: not sampled, token -1 and NaN noise), the same tokens and
    noise bits. `batched` (the default off the CPU) evaluates all rows' noise in one fixed sequence of tensor
    operations, masked to each row's finite logits, and reads the results once: on a GPU, where a row's own
    ~80 small kernels were the step's cost. On the CPU a row at a time over its finite logits only is faster
    (a vocabulary row stays in cache: 3.4 against 5.5 ms a row at V = 49,152, AMD EPYC (avx2), torch's ops)."""
    r = logits_RV.shape[0]
    chosen, noise = [-1] * r, [float("nan")] * r
    sampled = [i for i, key in enumerate(keys) if key is not None]
    if batched is None:
        batched = devices.off_cpu(logits_RV)
    if not sampled:
        return chosen, noise
    if not batched:
        for i in sampled:
            chosen[i], noise[i] = gumbel_choice(logits_RV[i], keys[i], None if finite_RV is None else finite_RV[i])
        return chosen, noise
    index = None if len(sampled) == r else tensor_on(sampled, logits_RV.device, torch.int64)
    x_SV = logits_RV if index is None else logits_RV.index_select(0, index)
    finite_SV = (
        torch.isfinite(x_SV)
        if finite_RV is None
        else (finite_RV if index is None else finite_RV.index_select(0, index))
    )
    words = rng.key_words([keys[i] for i in sampled], x_SV.device)
    tokens, noise_S = (t.tolist() for t in read_once(list(_batched_choice_tensors(x_SV, words, finite_SV))))
    for i, token, g in zip(sampled, tokens, noise_S):
        chosen[i], noise[i] = token, g
    return chosen, noise


def _batched_choice_tensors(
    x_SV: torch.Tensor, keys_S2: torch.Tensor, finite_SV: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gumbel-max over each row's finite logits, all rows in a few passes (NOISE_ELEMENTS_PER_PASS each):
    argmax of logits + noise with the other tokens at -inf (ties to the lowest id, as gumbel_choice's argmax
    over the ascending finite ids), and the chosen tokens' noise gathered from the pass: (S,) int64 tokens (-1 for
    a row without a finite logit), (S,) float64 noise (NaN there), where the logits are."""
    s, vocab = x_SV.shape
    hashes_V = rng.token_hashes(vocab, x_SV.device)
    step = max(1, NOISE_ELEMENTS_PER_PASS // max(vocab, 1))
    tokens, noise = [], []
    for start in range(0, s, step):
        part = slice(start, start + step)
        g_SV = rng.gumbel_rows(keys_S2[part], hashes_V)
        score_SV = (x_SV[part].double() + g_SV).masked_fill_(~finite_SV[part], float("-inf"))
        token_S = torch.argmax(score_SV, dim=-1, keepdim=True)
        tokens.append(token_S)
        noise.append(g_SV.gather(1, token_S))
    any_S = finite_SV.any(dim=-1)
    token_S = torch.where(any_S, torch.cat(tokens).squeeze(1), -1)
    noise_S = torch.where(any_S, torch.cat(noise).squeeze(1), float("nan"))
    return token_S, noise_S


def gumbel_choice(
    logits_V: torch.Tensor, key: tuple[int, int], finite_V: torch.Tensor | None = None
) -> tuple[int, float]:
    """The Gumbel-max token of one row over its finite logits (`finite_V`, when known) and its noise, in
    torch: the same bits as the native kernel; -1 and NaN when no logit is finite."""
    finite_V = torch.isfinite(logits_V) if finite_V is None else finite_V
    ids = finite_V.nonzero().flatten()
    if ids.numel() == 0:
        return -1, float("nan")
    g = rng.gumbel(key, rng.token_hashes(logits_V.shape[0], logits_V.device)[ids])
    j = int(torch.argmax(logits_V[ids].double() + g))
    return int(ids[j]), float(g[j])


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) of the k largest of each row (the last axis), largest first, equal values by ascending id (a NaN
    counts as the largest, -0.0 as 0.0): one answer on every device. torch.topk's order of ties, and which of them
    it keeps at the k-th place, are the device's own (an H200's differed from the CPU's, and the CPU's is no rule).
    On the CPU: torch.topk of k + 1, then each row's k put in order, and a tie at the k-th place settled by the
    lowest tied ids. Elsewhere, with no read: one int64 a value (its order-keeping bits over its id) in one topk
    (float64: a stable sort)."""
    if not 0 <= k <= x.shape[-1]:
        raise ValueError(f"top_k: k = {k} outside [0, {x.shape[-1]}]")
    return _top_k_device(x, k) if devices.off_cpu(x) else _top_k_host(x, k)


def _top_k_device(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dtype == torch.float64:
        values, ids = torch.sort(x, dim=-1, descending=True, stable=True)
        return values[..., :k], ids[..., :k]
    f = x.float() + 0.0  # -0.0 + 0.0 is 0.0
    bits = torch.where(torch.isnan(f), float("nan"), f).view(torch.int32).to(torch.int64)
    order = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # a negative float's magnitude bits reversed
    vocab = x.shape[-1]
    order.mul_(1 << 32).add_(torch.arange(vocab - 1, -1, -1, device=x.device))  # in place: R x V int64 is large
    ids = torch.topk(order, k, dim=-1).indices
    return x.gather(-1, ids), ids


def _rank(pair: tuple[float, int]) -> tuple[bool, float, int]:
    value, token = pair
    return value == value, -value if value == value else 0.0, token  # NaN first, then descending, then the id


def _top_k_host(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    x_RV = x.reshape(-1, x.shape[-1])
    values, ids = torch.topk(x_RV, min(k + 1, x_RV.shape[1]), dim=-1)
    chosen = []
    for r, (vs, ts) in enumerate(zip(values.tolist(), ids.tolist())):
        kth = vs[k - 1] if k else 0.0
        if len(vs) > k > 0 and (vs[k] == kth or vs[k] != vs[k] and kth != kth):  # tied at the k-th place
            above = [(v, t) for v, t in zip(vs, ts) if v != v or v > kth] if kth == kth else []
            tied = (x_RV[r] == kth) if kth == kth else torch.isnan(x_RV[r])
            pairs = sorted(above, key=_rank) + [(kth, int(t)) for t in tied.nonzero()[: k - len(above), 0]]
        else:
            pairs = sorted(zip(vs[:k], ts[:k]), key=_rank)
        chosen.append([t for _, t in pairs])
    ids_RK = torch.tensor(chosen, dtype=torch.int64).reshape(*x.shape[:-1], k)
    return x.gather(-1, ids_RK), ids_RK


def _top(logits_RV: torch.Tensor, lse_R: torch.Tensor, rows: list[SampleRow], k: int) -> list[list[tuple[int, float]]]:
    if k == 0:
        return [[] for _ in rows]
    values, ids = top_k(logits_RV, k)
    return _top_lists((values - lse_R.unsqueeze(1)).tolist(), ids.tolist(), rows)


def _top_lists(values: list[list[float]], ids: list[list[int]], rows: list[SampleRow]) -> list[list[tuple[int, float]]]:
    """Each row's alternatives from its top-k logprobs and ids: its own number of them, none at -inf."""
    return [
        [(t, v) for t, v in zip(ids[i][: row.num_top], values[i][: row.num_top]) if v != float("-inf")]
        for i, row in enumerate(rows)
    ]
