"""HF transformers' LlamaForCausalLM on the same weights: the external reference."""

from __future__ import annotations

import functools

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from toolkit.config import ModelConfig
from toolkit.models.loading import load_checkpoint

hf_logging.set_verbosity_error()


@functools.lru_cache(maxsize=4)
def hf_model(cfg: ModelConfig) -> LlamaForCausalLM:
    ckpt = load_checkpoint(cfg)
    model = LlamaForCausalLM(LlamaConfig(**ckpt.arch.to_hf_config()))
    missing, unexpected = model.load_state_dict(ckpt.state_dict, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


@torch.inference_mode()
def hf_logits(cfg: ModelConfig, token_ids: list[int]) -> torch.Tensor:
    return hf_model(cfg)(torch.tensor([token_ids])).logits[0].float()


@torch.inference_mode()
def hf_greedy(cfg: ModelConfig, token_ids: list[int], max_new_tokens: int) -> list[int]:
    out = hf_model(cfg).generate(torch.tensor([token_ids]), attention_mask=torch.ones(1, len(token_ids), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(token_ids):].tolist()
