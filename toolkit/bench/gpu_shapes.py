"""The shapes `python -m toolkit.bench.gpu --shape` gives random weights: a Llama of SHAPES's sizes (the engine's
random-init `tiny` model), another family's HF config (CONFIG_SHAPES), or any HF config.json of a family the engine
reads, with HF transformers' own random init (a GPU machine reaches no model hub)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from toolkit.bench.precision import SMOLLM2_SHAPE
from toolkit.config import ModelConfig
from toolkit.errors import ModelLoadError, one_line
from toolkit.models import DTYPES, LoadedModel, from_checkpoint, load_model
from toolkit.models.loading import hf_reference_model, load_checkpoint, random_checkpoint

SHAPES = {
    "smollm2": SMOLLM2_SHAPE,
    # Llama-3.2-1B's dimensions (tied embeddings; its long-context RoPE scaling changes no cost at these lengths)
    "llama1b": dict(
        name="tiny",
        seed=0,
        vocab_size=128256,
        num_layers=16,
        hidden_size=2048,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=8192,
        rope_theta=500000.0,
        max_position_embeddings=131072,
    ),
    "tiny": dict(
        name="tiny",
        seed=0,
        vocab_size=512,
        num_layers=2,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=512,
    ),
}
# other families' shapes as their HF config.json has them, for HF transformers' random init (`random_checkpoint`)
CONFIG_SHAPES = {
    # Qwen3-0.6B (vLLM's 4.2 ms a token at batch 1 in issue 56): q/k norms, 16 heads of 128 over a hidden of 1024,
    # 8 KV heads, a vocabulary of 151,936
    "qwen3-0.6b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
}


def shape_source(value: str) -> str | Path:
    """--shape: a named shape, or an HF config.json (or the directory holding one) to give random weights."""
    if value in SHAPES or value in CONFIG_SHAPES:
        return value
    path = Path(value).expanduser()
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither a shape ({', '.join(sorted(SHAPES) + sorted(CONFIG_SHAPES))}) nor a config.json "
            "or a directory holding one"
        )
    return path


def shape_config(shape: str | Path) -> dict[str, Any] | None:
    """The HF config of a shape given as one (a config.json, or CONFIG_SHAPES's); None: a Llama of SHAPES's sizes."""
    if isinstance(shape, str):
        return CONFIG_SHAPES.get(shape)
    try:
        config = json.loads(shape.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {shape}: {one_line(exc)}") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{shape} holds no JSON object")
    return config


def shape_model(shape: str | Path, dtype: str, device: torch.device, hf: bool) -> tuple[LoadedModel, Any]:
    """The engine's model of `shape` in `dtype` on `device`, random weights, and (`hf`) HF transformers' model on
    the same weights, else None. A config's weights are HF's own init, made once on the device."""
    config = shape_config(shape)
    if config is not None:
        ckpt, model = random_checkpoint(config, str(shape), device=device)
        loaded = from_checkpoint(ckpt, ModelConfig(name="hf", path=str(shape), dtype=dtype), device)
        return loaded, model.to(dtype=DTYPES[dtype]) if hf else None  # after the engine's copy: fp32's shares
    loaded = load_model(ModelConfig(**SHAPES[shape], dtype=dtype), device=device)
    if not hf:
        return loaded, None
    return loaded, hf_reference_model(load_checkpoint(loaded.config)).to(device=device, dtype=DTYPES[dtype])
