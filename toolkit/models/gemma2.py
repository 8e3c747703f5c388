"""The Gemma2 family (Gemma Team 2024): Llama's skeleton with scaled embeddings, RMSNorms
that scale by (1 + w) and also follow attention and the MLP, a GeGLU MLP, soft-capped
attention and final logits, and sliding-window attention on every other layer."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from toolkit.errors import ModelLoadError
from toolkit.models import llama
from toolkit.models.decoder import DecoderArch

MODEL_TYPES = ("gemma2",)


def from_hf_config(cfg: Mapping[str, Any]) -> DecoderArch:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_new"):
        raise ModelLoadError(f"unsupported Gemma2 hidden_activation {act!r}")
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    window = cfg.get("sliding_window")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention") if window else ()
    base = llama.from_hf_config({k: v for k, v in cfg.items() if k not in ("sliding_window", "attention_bias")})
    return dataclasses.replace(
        base,
        family="gemma2",
        activation="gelu_tanh",
        sandwich_norm=True,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        embed_scale=cfg["hidden_size"] ** 0.5,
        query_scale=float(cfg.get("query_pre_attn_scalar") or base.head_dim) ** -0.5,
        attn_softcap=cfg.get("attn_logit_softcapping"),
        final_softcap=cfg.get("final_logit_softcapping"),
        sliding_window=window if sliding else None,
        sliding_layers=sliding,
    )


def canonical_weights(arch: DecoderArch, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = llama.canonical_weights(arch, sd)
    for i in range(arch.num_layers):
        p, c = f"model.layers.{i}.", f"layers.{i}."
        # Gemma2's post_attention_layernorm follows attention; the pre-MLP norm is pre_feedforward_layernorm
        out[c + "post_attn_norm"] = out.pop(c + "ln_mlp")
        out[c + "ln_mlp"] = llama.need(sd, p + "pre_feedforward_layernorm.weight")
        out[c + "post_mlp_norm"] = llama.need(sd, p + "post_feedforward_layernorm.weight")
    # its RMSNorm scales by (1 + w): fold the 1 in once (the same fp32 sum HF computes per call)
    return {k: (v.float() + 1.0).to(v.dtype) if _is_norm(k) else v for k, v in out.items()}


def _is_norm(name: str) -> bool:
    return name == "norm" or name.rsplit(".", 1)[-1] in ("ln_attn", "ln_mlp", "post_attn_norm", "post_mlp_norm")
