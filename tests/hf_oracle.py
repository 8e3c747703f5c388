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
def hf_greedy_with_margins(
    cfg: ModelConfig, token_ids: list[int], max_new_tokens: int
) -> tuple[list[int], list[float]]:
    """HF's greedy continuation and, for each of its tokens, the top-2 logprob margin it was chosen by."""
    from tests.numerics import top2_margin

    out = hf_model(cfg).generate(
        torch.tensor([token_ids]),
        attention_mask=torch.ones(1, len(token_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, len(token_ids) :].tolist(), [top2_margin(step[0]) for step in out.logits]
