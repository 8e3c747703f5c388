"""Model loading and the model families the engine can run."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from toolkit.config import ModelConfig
from toolkit.models.decoder import DecoderArch, PagedDecoder
from toolkit.models.families import canonical_weights
from toolkit.models.loading import Checkpoint, load_checkpoint
from toolkit.models.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    model: PagedDecoder
    tokenizer: Tokenizer | None
    arch: DecoderArch
    name: str
    model_id: str
    revision: str
    config: ModelConfig
    generation: dict = field(default_factory=dict)  # the checkpoint's sampling defaults (generation_config)


def load_model(cfg: ModelConfig, device: str | torch.device = "cpu") -> LoadedModel:
    return from_checkpoint(load_checkpoint(cfg), cfg, device)


def from_checkpoint(ckpt: Checkpoint, cfg: ModelConfig, device: str | torch.device = "cpu") -> LoadedModel:
    """The engine's model of a checkpoint's weights, in `cfg.dtype` on `device` (`cfg`: where they came from)."""
    dtype = DTYPES[cfg.dtype]
    state_dict = {k: v.to(dtype) for k, v in canonical_weights(ckpt.arch, ckpt.state_dict).items()}
    model = PagedDecoder(ckpt.arch, state_dict).to(device)
    model.eval()
    return LoadedModel(
        model=model,
        tokenizer=ckpt.tokenizer,
        arch=ckpt.arch,
        name=ckpt.name,
        model_id=ckpt.model_id,
        revision=ckpt.revision,
        config=cfg,
        generation=dict(ckpt.generation),
    )


__all__ = [
    "Checkpoint",
    "DecoderArch",
    "PagedDecoder",
    "LoadedModel",
    "Tokenizer",
    "from_checkpoint",
    "load_checkpoint",
    "load_model",
]
