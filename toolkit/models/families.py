"""The model-family registry: HF `model_type` -> the module that reads that family.

A family module has `MODEL_TYPES`, `from_hf_config(cfg) -> DecoderArch` and
`canonical_weights(arch, state_dict)`; all of them run on `toolkit.models.decoder.PagedDecoder`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any

import torch

from toolkit.errors import ModelLoadError
from toolkit.models import gemma2, gpt2, llama, qwen
from toolkit.models.decoder import DecoderArch

FAMILIES: dict[str, ModuleType] = {t: m for m in (llama, qwen, gpt2, gemma2) for t in m.MODEL_TYPES}


def family_of(model_type: Any) -> ModuleType:
    if model_type not in FAMILIES:
        raise ModelLoadError(f"unsupported model_type {model_type!r}; supported: {', '.join(FAMILIES)}")
    return FAMILIES[model_type]


def arch_from_hf_config(cfg: Mapping[str, Any]) -> DecoderArch:
    family = family_of(cfg.get("model_type"))
    for key in HF_SIZES:
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ModelLoadError(f"config.json's {key} must be a positive integer, got {value!r}")
    try:
        arch = family.from_hf_config(cfg)
    except KeyError as exc:
        raise ModelLoadError(f"config.json of a {cfg.get('model_type')} model lacks {exc.args[0]!r}") from None
    check_shape(arch)
    return arch


# every family's sizes (HF's names): each a positive integer where given
HF_SIZES = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "max_position_embeddings", "n_embd", "n_layer", "n_head", "n_inner", "n_positions",
)  # fmt: skip


def check_shape(arch: DecoderArch) -> None:
    """A config.json whose heads no decoder has is refused in one line: 6 query heads over 4 KV heads loaded, and
    the GPU's attention left two heads unwritten (uninitialised memory, no error) while the CPU's torch attention
    crashed mid-step."""
    if arch.num_heads % arch.num_kv_heads:
        raise ModelLoadError(
            f"config.json's num_attention_heads ({arch.num_heads}) must be a multiple of num_key_value_heads"
            f" ({arch.num_kv_heads}): each KV head serves the same number of query heads"
        )
    if arch.positions == "rope" and arch.head_dim % 2:
        raise ModelLoadError(f"config.json's head_dim ({arch.head_dim}) must be even for rotary positions")


def canonical_weights(arch: DecoderArch, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return family_of(arch.family).canonical_weights(arch, state_dict)
