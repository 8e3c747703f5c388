"""The GPT-2 family (Radford et al. 2019), which nanoGPT reimplements: learned absolute
positions, LayerNorm with biases, multi-head attention with biases, a GELU (tanh) MLP, the LM
head tied to the token embedding. HF stores its projections as Conv1D, (in, out)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from toolkit.errors import ModelLoadError
from toolkit.models.decoder import DecoderArch
from toolkit.models.llama import eos_ids, need

MODEL_TYPES = ("gpt2",)
GELU = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def from_hf_config(cfg: Mapping[str, Any]) -> DecoderArch:
    act = cfg.get("activation_function", "gelu_new")
    if act not in GELU:
        raise ModelLoadError(f"unsupported GPT-2 activation_function {act!r}; supported: {', '.join(GELU)}")
    if cfg.get("scale_attn_by_inverse_layer_idx") or cfg.get("reorder_and_upcast_attn"):
        raise ModelLoadError(
            "GPT-2 checkpoints with scale_attn_by_inverse_layer_idx or reorder_and_upcast_attn are not supported"
        )
    hidden, heads = cfg["n_embd"], cfg["n_head"]
    return DecoderArch(
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        num_layers=cfg["n_layer"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=cfg.get("n_inner") or 4 * hidden,
        rms_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        rope_theta=0.0,
        max_position_embeddings=cfg.get("n_positions", 1024),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        eos_token_ids=eos_ids(cfg),
        family="gpt2",
        norm="layer",
        positions="learned",
        gated_mlp=False,
        activation=GELU[act],
    )


def to_hf_config(arch: DecoderArch) -> dict[str, Any]:
    """A config.json that HF's GPT2LMHeadModel reads back to the same architecture."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": arch.vocab_size,
        "n_embd": arch.hidden_size,
        "n_layer": arch.num_layers,
        "n_head": arch.num_heads,
        "n_inner": arch.intermediate_size,
        "n_positions": arch.max_position_embeddings,
        "layer_norm_epsilon": arch.rms_norm_eps,
        "activation_function": "gelu_new",
        "tie_word_embeddings": True,
        "eos_token_id": arch.eos_token_ids[0] if arch.eos_token_ids else None,
        "bos_token_id": arch.eos_token_ids[0] if arch.eos_token_ids else None,
        "torch_dtype": "float32",
    }


def canonical_weights(arch: DecoderArch, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}  # the hub's gpt2 has no prefix
    out = {
        "embed": need(sd, "wte.weight"),
        "pos_embed": need(sd, "wpe.weight"),
        "norm": need(sd, "ln_f.weight"),
        "norm_b": need(sd, "ln_f.bias"),
    }
    if not arch.tie_word_embeddings:
        out["lm_head"] = need(sd, "lm_head.weight")
    for i in range(arch.num_layers):
        p, c = f"h.{i}.", f"layers.{i}."
        out[c + "ln_attn"], out[c + "ln_attn_b"] = need(sd, p + "ln_1.weight"), need(sd, p + "ln_1.bias")
        out[c + "w_qkv"], out[c + "b_qkv"] = need(sd, p + "attn.c_attn.weight").t(), need(sd, p + "attn.c_attn.bias")
        out[c + "w_o"], out[c + "b_o"] = need(sd, p + "attn.c_proj.weight").t(), need(sd, p + "attn.c_proj.bias")
        out[c + "ln_mlp"], out[c + "ln_mlp_b"] = need(sd, p + "ln_2.weight"), need(sd, p + "ln_2.bias")
        out[c + "w_up"], out[c + "b_up"] = need(sd, p + "mlp.c_fc.weight").t(), need(sd, p + "mlp.c_fc.bias")
        out[c + "w_down"], out[c + "b_down"] = need(sd, p + "mlp.c_proj.weight").t(), need(sd, p + "mlp.c_proj.bias")
    return out
