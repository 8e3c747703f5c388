"""Random-init tiny HF checkpoints of every supported family, written as config.json + safetensors."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import torch

VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    intermediate_size=96,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    eos_token_id=1,
    bos_token_id=1,
    tie_word_embeddings=True,
)
CONFIGS = {
    "llama": dict(model_type="llama", num_key_value_heads=2, **COMMON),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=2, **COMMON),
    "qwen3": dict(model_type="qwen3", num_key_value_heads=2, head_dim=32, **COMMON),
    "gemma2": dict(
        model_type="gemma2",
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=4.0,
        final_logit_softcapping=6.0,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        **{k: v for k, v in COMMON.items() if k != "tie_word_embeddings"},
    ),
    "gpt2": dict(
        model_type="gpt2",
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=3,
        n_head=4,
        n_positions=256,
        eos_token_id=1,
        bos_token_id=1,
    ),
}

# shapes one test runs, not every family test: GPT-2 at an MLP width of 200, which no CPU's vector loop step (16, 32)
# divides (tests/test_batch_invariant.py)
ODD_CONFIGS = {
    "gpt2_odd": dict(
        model_type="gpt2",
        vocab_size=VOCAB,
        n_embd=50,
        n_layer=2,
        n_head=5,
        n_positions=256,
        eos_token_id=1,
        bos_token_id=1,
    ),
}


@functools.cache
def checkpoint_dir(family: str) -> Path:
    """HF's own random init, rescaled so logits span a few units (no greedy near-ties), saved once."""
    import transformers

    spec = {**CONFIGS, **ODD_CONFIGS}[family]
    config = transformers.AutoConfig.for_model(**spec)
    torch.manual_seed(hash(family) % 1000)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(sum(map(ord, family)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                fan_in = (
                    p.shape[1]
                    if not name.endswith(("c_attn.weight", "c_fc.weight", "c_proj.weight"))
                    or spec["model_type"] != "gpt2"
                    else p.shape[0]
                )
                std = 0.5 if "emb" in name or "wte" in name or "wpe" in name else fan_in**-0.5
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif "norm" in name or "ln_" in name:
                base = 0.0 if family == "gemma2" else 1.0  # Gemma2's RMSNorm scales by (1 + w)
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen)) if name.endswith("weight") else p.copy_(
                    0.1 * torch.randn(p.shape, generator=gen)
                )
            else:  # biases
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    out = Path(tempfile.mkdtemp(prefix=f"toolkit-{family}-"))
    model.save_pretrained(out)
    return out
