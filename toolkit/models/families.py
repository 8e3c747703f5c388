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
    try:
        return family.from_hf_config(cfg)
    except KeyError as exc:
        raise ModelLoadError(f"config.json of a {cfg.get('model_type')} model lacks {exc.args[0]!r}") from None


def canonical_weights(arch: DecoderArch, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return family_of(arch.family).canonical_weights(arch, state_dict)
