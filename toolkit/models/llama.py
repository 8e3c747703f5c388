"""The Llama family (SmolLM2, Llama 2/3, TinyLlama, Mistral without sliding windows).

References: Touvron et al. 2023 (Llama); Su et al. 2021 (RoPE); Ainslie et al. 2023 (GQA);
Shazeer 2020 (SwiGLU). The weights are HF transformers' LlamaForCausalLM weights; the
projections are fused at load (q|k|v and gate|up) so a layer runs four GEMMs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from toolkit.errors import ModelLoadError
from toolkit.models.decoder import DecoderArch

MODEL_TYPES = ("llama", "mistral")


def eos_ids(cfg: Mapping[str, Any]) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    return tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))


def default_rope_theta(cfg: Mapping[str, Any]) -> float:
    """rope_theta of a checkpoint whose RoPE is the plain one (scaled variants are refused)."""
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ModelLoadError(f"unsupported rope_type {rope_type!r}; supported: default")
    return float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0)


def from_hf_config(cfg: Mapping[str, Any]) -> DecoderArch:
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ModelLoadError("Llama checkpoints with attention_bias or mlp_bias are not supported")
    if cfg.get("sliding_window"):
        raise ModelLoadError("sliding-window attention is not supported for the Llama family")
    heads = cfg["num_attention_heads"]
    return DecoderArch(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg["intermediate_size"],
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=default_rope_theta(cfg),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        eos_token_ids=eos_ids(cfg),
    )


def to_hf_config(arch: DecoderArch) -> dict[str, Any]:
    """A config.json that HF's LlamaForCausalLM reads back to the same architecture."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "intermediate_size": arch.intermediate_size,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": arch.rope_theta},
        "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "eos_token_id": list(arch.eos_token_ids) or None,
        "torch_dtype": "float32",
    }


def canonical_weights(
    arch: DecoderArch, sd: Mapping[str, torch.Tensor], *, qkv_bias: bool = False, qk_norm: bool = False
) -> dict[str, torch.Tensor]:
    """HF Llama-layout names (shared by Qwen2/Qwen3) -> the decoder's canonical names."""
    out = {
        "embed": need(sd, "model.embed_tokens.weight"),
        "norm": need(sd, "model.norm.weight"),
        "lm_head": None if arch.tie_word_embeddings else need(sd, "lm_head.weight"),
    }
    for i in range(arch.num_layers):
        p, a, c = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"layers.{i}."
        out[c + "w_qkv"] = _cat(sd, [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"])
        if qkv_bias:
            out[c + "b_qkv"] = _cat(sd, [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"])
        if qk_norm:
            out[c + "q_norm"], out[c + "k_norm"] = need(sd, a + "q_norm.weight"), need(sd, a + "k_norm.weight")
        out[c + "w_o"] = need(sd, a + "o_proj.weight")
        out[c + "w_gate_up"] = _cat(sd, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
        out[c + "w_down"] = need(sd, p + "mlp.down_proj.weight")
        out[c + "ln_attn"] = need(sd, p + "input_layernorm.weight")
        out[c + "ln_mlp"] = need(sd, p + "post_attention_layernorm.weight")
    return {k: v for k, v in out.items() if v is not None}


def need(sd: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    """sd[key], or a one-line error naming the checkpoint tensor that is missing."""
    if key not in sd:
        raise ModelLoadError(f"checkpoint is missing tensor {key}")
    return sd[key]


def _cat(sd: Mapping[str, torch.Tensor], keys: list[str]) -> torch.Tensor:
    """The tensors concatenated along the output axis (a fused projection)."""
    return torch.cat([need(sd, k) for k in keys])
