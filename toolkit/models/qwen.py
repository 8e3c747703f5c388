"""The Qwen2 and Qwen3 families: Llama's layout plus q/k/v biases (Qwen2) or per-head
RMSNorm of queries and keys before RoPE (Qwen3, Yang et al. 2025)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from toolkit.errors import ModelLoadError
from toolkit.models import llama
from toolkit.models.decoder import DecoderArch

MODEL_TYPES = ("qwen2", "qwen3")


def from_hf_config(cfg: Mapping[str, Any]) -> DecoderArch:
    if cfg.get("use_sliding_window"):
        raise ModelLoadError("Qwen checkpoints with use_sliding_window=true are not supported")
    qwen3 = cfg.get("model_type") == "qwen3"
    if qwen3 and cfg.get("attention_bias"):
        raise ModelLoadError("Qwen3 checkpoints with attention_bias=true are not supported")
    base = llama.from_hf_config(
        {k: v for k, v in cfg.items() if k not in ("attention_bias", "sliding_window", "use_sliding_window")}
    )
    return dataclasses.replace(base, family=cfg["model_type"], qk_norm=qwen3)


def canonical_weights(arch: DecoderArch, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return llama.canonical_weights(arch, sd, qkv_bias=arch.family == "qwen2", qk_norm=arch.qk_norm)
