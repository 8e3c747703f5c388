"""The reference: an uncached forward pass that reads like a textbook.

Everything the engine computes is checked against this. It takes one sequence of token
ids, runs every position through the network at once with a plain causal mask, and
returns the logits at every position. No paging, no packing, no cache: if the engine's
logits for a position differ from these, the engine is wrong.

Its bits are a function of the token ids alone (on one CPU and torch build): not of the thread
count, not of the shard or process that computes it, not of how long a sequence a prefix is
computed in. BLAS picks its blocking, and with it the order of a dot product's sums, from the
shape and the threads; so every sum here has a shape fixed in advance and runs on one thread:

- each matrix product runs on blocks of exactly ROWS rows (the last padded with zero rows), so a
  row's dot products are computed by the same call whatever T is;
- attention reads keys in blocks of KEYS: each query block against each key block is one call of
  one shape, and the blocks' partial sums are added in block order; a key a query may not see has
  weight exactly 0, and adding an exact 0 changes no sum (for finite values, as a model's are), so
  a row depends only on the positions up to its own;
- the softmax's and RMSNorm's sums are balanced pairwise trees over a fixed (zero-padded) width;
- the whole forward runs on one torch thread (the caller's setting is restored after).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from toolkit.errors import ConfigError
from toolkit.models.decoder import PagedDecoder

ROWS = 16  # every matrix product runs on blocks of exactly this many rows
KEYS = 64  # attention reads keys in blocks of this many (a multiple of ROWS: a query block's keys fit the padding)
assert KEYS % ROWS == 0


@torch.inference_mode()
def reference_logits(model: PagedDecoder, token_ids: list[int], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Logits (T, V) of a full no-cache forward over `token_ids` (row t predicts token t+1).

    Computed in float64 by default, so the reference is more exact than any fp32 path it
    checks: a difference is the checked path's rounding (or a bug), never the oracle's. Row t's
    bits depend only on token_ids[: t + 1] (the module docstring says how).
    """
    a = model.arch
    if a.family != "llama":
        raise ConfigError(
            f"the textbook reference covers the Llama family only, not {a.family}: "
            f"use verify.reference=hf (HF transformers' {a.family})"
        )
    with one_thread():
        return _forward(model, token_ids, dtype)


def _forward(model: PagedDecoder, token_ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    a = model.arch
    device = model.embed.device
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    t = ids.shape[0]
    h_q, h_kv, d = a.num_heads, a.num_kv_heads, a.head_dim
    groups = h_q // h_kv
    w = lambda p: p.to(dtype)  # noqa: E731  (weights in the reference precision)

    # token embeddings: (T, hidden)
    x = w(model.embed[ids])
    # rotary position tables for positions 0..T-1: (T, 1, d)
    cos = model.rope_cos[:t].unsqueeze(1).to(dtype)
    sin = model.rope_sin[:t].unsqueeze(1).to(dtype)

    for layer in model.layers:
        # 1. attention block, pre-norm
        h = _rms_norm(x, w(layer.ln_attn), a.rms_norm_eps)
        qkv = _matmul(h, w(layer.w_qkv))  # (T, (h_q + 2 h_kv) * d)
        q = qkv[:, : h_q * d].view(t, h_q, d)
        k = qkv[:, h_q * d : (h_q + h_kv) * d].view(t, h_kv, d)
        v = qkv[:, (h_q + h_kv) * d :].view(t, h_kv, d)
        # rotate queries and keys by their position
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        # every query head reads the key/value head of its group
        k = k.repeat_interleave(groups, dim=1)  # (T, h_q, d)
        v = v.repeat_interleave(groups, dim=1)
        # causal attention: each position reads the values of positions 0..itself
        attended = _causal_attention(q, k, v, d**-0.5).reshape(t, h_q * d)
        x = x + _matmul(attended, w(layer.w_o))

        # 2. SwiGLU feed-forward block, pre-norm
        h = _rms_norm(x, w(layer.ln_mlp), a.rms_norm_eps)
        gate, up = _matmul(h, w(layer.w_gate_up)).chunk(2, dim=-1)
        x = x + _matmul(F.silu(gate) * up, w(layer.w_down))

    # final norm and the LM head at every position
    return _matmul(_rms_norm(x, w(model.norm), a.rms_norm_eps), w(model.lm_head_t))


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread inside the block (the process's setting restored after): BLAS and torch's
    reductions split their work by the thread count, so a sum's order can depend on it."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """x with zero rows appended (dim 0) up to a multiple of `multiple` rows."""
    extra = -x.shape[0] % multiple
    return F.pad(x, (0, 0) * (x.dim() - 1) + (0, extra)) if extra else x


def _matmul(x_TK: torch.Tensor, w_KN: torch.Tensor) -> torch.Tensor:
    """x @ w, one block of ROWS rows at a time (rows past T are zeros): every call has one shape, so each
    row's dot products are summed the same way whatever T is. (T, N)"""
    t = x_TK.shape[0]
    x = _pad_rows(x_TK.contiguous(), ROWS)
    return torch.cat([x[i : i + ROWS] @ w_KN for i in range(0, x.shape[0], ROWS)])[:t]


def _tree_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum over the last dim as a balanced pairwise tree over the next power-of-two width (zero-padded):
    its order is fixed by the width, whatever the vector unit or the threads. (..., 1)"""
    width = 1 << max(x.shape[-1] - 1, 0).bit_length()
    x = F.pad(x, (0, width - x.shape[-1]))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def _causal_attention(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale, causal) v for every head, in fixed blocks (the module docstring): query block by
    key block, each block of scores and of weighted values one call of one shape; per row, the max over every
    key block it can see (exact in any order) and the blocks' sums added in block order. (T, H, D)"""
    t = q_THD.shape[0]
    q = _pad_rows(q_THD, ROWS).transpose(0, 1)  # (H, Tq, D), Tq a multiple of ROWS
    k = _pad_rows(k_THD, KEYS).transpose(0, 1)  # (H, Tk, D), Tk a multiple of KEYS
    v = _pad_rows(v_THD, KEYS).transpose(0, 1).contiguous()
    out, device = [], q_THD.device
    for q0 in range(0, q.shape[1], ROWS):
        q_blk = q[:, q0 : q0 + ROWS].contiguous()  # (H, ROWS, D)
        rows = torch.arange(q0, q0 + ROWS, device=device).unsqueeze(1)  # (ROWS, 1): the block's query positions
        starts = range(0, q0 + ROWS, KEYS)  # the key blocks this query block can see (not T: a prefix's rows
        scores = []  # are computed by the same calls in a longer sequence); each (H, ROWS, KEYS)
        for k0 in starts:
            s = torch.bmm(q_blk, k[:, k0 : k0 + KEYS].transpose(1, 2).contiguous()) * scale
            scores.append(s.masked_fill(torch.arange(k0, k0 + KEYS, device=device) > rows, float("-inf")))
        top = torch.stack([s.amax(-1, keepdim=True) for s in scores]).amax(0)  # (H, ROWS, 1)
        total = acc = None
        for k0, s in zip(starts, scores):
            p = torch.exp(s - top)  # exactly 0 where masked
            part, weighted = _tree_sum(p), torch.bmm(p, v[:, k0 : k0 + KEYS])
            total = part if total is None else total + part
            acc = weighted if acc is None else acc + weighted
        out.append(acc / total)
    return torch.cat(out, dim=1).transpose(0, 1)[:t]  # (T, H, D)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight (the mean's sum a fixed tree: _tree_sum)."""
    return weight * (x * torch.rsqrt(_tree_sum(x * x) / x.shape[-1] + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
