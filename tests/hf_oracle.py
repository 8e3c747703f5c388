"""HF transformers' implementation of the model's family on the same weights: the external reference."""

from __future__ import annotations

import functools

import torch

from toolkit.config import ModelConfig
from toolkit.models.loading import hf_reference_model, load_checkpoint


@functools.lru_cache(maxsize=8)
def hf_model(cfg: ModelConfig):
    return hf_reference_model(load_checkpoint(cfg))


@torch.inference_mode()
def hf_logits(cfg: ModelConfig, token_ids: list[int]) -> torch.Tensor:
    return hf_model(cfg)(torch.tensor([token_ids])).logits[0].float()


@torch.inference_mode()
def hf_greedy(cfg: ModelConfig, token_ids: list[int], max_new_tokens: int) -> list[int]:
    out = hf_model(cfg).generate(torch.tensor([token_ids]), attention_mask=torch.ones(1, len(token_ids), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(token_ids):].tolist()
