"""The reference: an uncached forward pass that reads like a textbook.

Everything the engine computes is checked against this. It takes one sequence of token
ids, runs every position through the network at once with a plain causal mask, and
returns the logits at every position. No paging, no packing, no cache: if the engine's
logits for a position differ from these, the engine is wrong.
"""

from __future__ import annotations

import torch

from toolkit.errors import ConfigError
from toolkit.models.decoder import PagedDecoder


@torch.inference_mode()
def reference_logits(model: PagedDecoder, token_ids: list[int], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Logits (T, V) of a full no-cache forward over `token_ids` (row t predicts token t+1).

    Computed in float64 by default, so the reference is more exact than any fp32 path it
    checks: a difference is the checked path's rounding (or a bug), never the oracle's.
    """
    a = model.arch
    if a.family != "llama":
        raise ConfigError(f"the textbook reference covers the Llama family only, not {a.family}: "
                          f"use verify.reference=hf (HF transformers' {a.family})")
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
    # causal mask: position i sees positions 0..i
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()

    for layer in model.layers:
        # 1. attention block, pre-norm
        h = _rms_norm(x, w(layer.ln_attn), a.rms_norm_eps)
        qkv = h @ w(layer.w_qkv)  # (T, (h_q + 2 h_kv) * d)
        q = qkv[:, : h_q * d].view(t, h_q, d)
        k = qkv[:, h_q * d: (h_q + h_kv) * d].view(t, h_kv, d)
        v = qkv[:, (h_q + h_kv) * d:].view(t, h_kv, d)
        # rotate queries and keys by their position
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        # every query head reads the key/value head of its group
        k = k.repeat_interleave(groups, dim=1)  # (T, h_q, d)
        v = v.repeat_interleave(groups, dim=1)
        # scores: (h_q, T, T), masked so no position looks ahead
        scores = torch.einsum("qhd,khd->hqk", q, k) * d ** -0.5
        scores = scores.masked_fill(~causal, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        attended = torch.einsum("hqk,khd->qhd", weights, v).reshape(t, h_q * d)
        x = x + attended @ w(layer.w_o)

        # 2. SwiGLU feed-forward block, pre-norm
        h = _rms_norm(x, w(layer.ln_mlp), a.rms_norm_eps)
        gate, up = (h @ w(layer.w_gate_up)).chunk(2, dim=-1)
        x = x + (torch.nn.functional.silu(gate) * up) @ w(layer.w_down)

    # final norm and the LM head at every position
    return _rms_norm(x, w(model.norm), a.rms_norm_eps) @ w(model.lm_head_t)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
