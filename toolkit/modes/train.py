"""mode=train: a character-level GPT (nanoGPT's model, Karpathy 2022) trained on a local text file.

    python run.py mode=train model=nanogpt train.text=input.txt
    python run.py model=nanogpt model.path=<run dir>/nanogpt workload=text    # serve it

The model is GPT-2's architecture at a small size; the checkpoint is written as a HF GPT-2
checkpoint (config.json, model.safetensors) plus a character tokenizer (tokenizer.json:
one token per character, built with HF `tokenizers`), so the engine serves it through the
GPT-2 family and HF transformers can load it as the reference.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from toolkit.errors import ConfigError
from toolkit.models import gpt2
from toolkit.models.decoder import DecoderArch

EOS = "<|endoftext|>"
UNK = "<unk>"


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.attn_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class CharGPT(nn.Module):
    def __init__(self, vocab: int, context: int, layers: int, d: int, heads: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        for name, p in self.named_parameters():  # GPT-2's init; residual projections scaled by depth
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()  # tied LM head

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """HF GPT2LMHeadModel names; its Conv1D projections store (in, out)."""
        out = {
            "transformer.wte.weight": self.wte.weight,
            "transformer.wpe.weight": self.wpe.weight,
            "transformer.ln_f.weight": self.ln_f.weight,
            "transformer.ln_f.bias": self.ln_f.bias,
        }
        for i, blk in enumerate(self.h):
            p = f"transformer.h.{i}."
            for hf_name, mod in (("ln_1", blk.ln_1), ("ln_2", blk.ln_2)):
                out[p + hf_name + ".weight"], out[p + hf_name + ".bias"] = mod.weight, mod.bias
            for hf_name, lin in (
                ("attn.c_attn", blk.c_attn),
                ("attn.c_proj", blk.attn_proj),
                ("mlp.c_fc", blk.c_fc),
                ("mlp.c_proj", blk.mlp_proj),
            ):
                out[p + hf_name + ".weight"], out[p + hf_name + ".bias"] = lin.weight.t(), lin.bias
        return {k: v.detach().contiguous().clone() for k, v in out.items()}


def char_tokenizer(chars: list[str]):
    """A HF `tokenizers` tokenizer with one token per character (ids 0, 1: end of text, unknown)."""
    vocab = {EOS: 0, UNK: 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([EOS, UNK])
    return tok


def train(cfg: dict[str, Any], model_cfg: dict[str, Any], out_dir: Path, log=print) -> dict[str, Any]:
    """Train on cfg["text"]; write the checkpoint to out_dir; return the losses."""
    path = Path(str(cfg.get("text") or "")).expanduser()
    if not cfg.get("text") or not path.is_file():
        raise ConfigError(f"train.text must name a local text file, got {cfg.get('text')!r}")
    text = path.read_text(encoding="utf-8", errors="replace")
    context = int(model_cfg["max_position_embeddings"])
    if len(text) < 4 * (context + 1):
        raise ConfigError(
            f"train.text has {len(text)} characters; it needs at least {4 * (context + 1)} "
            f"(4 x model.max_position_embeddings + 4)"
        )
    chars = sorted(set(text))
    tok = char_tokenizer(chars)
    data = torch.tensor(tok.encode(text).ids, dtype=torch.long)
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]
    gen = torch.Generator().manual_seed(int(cfg.get("seed", 0)))
    torch.manual_seed(int(cfg.get("seed", 0)))  # nn.Module init draws from torch's RNG; training only
    layers, d, heads = int(model_cfg["num_layers"]), int(model_cfg["hidden_size"]), int(model_cfg["num_heads"])
    model = CharGPT(len(chars) + 2, context, layers, d, heads)
    opt = torch.optim.AdamW(model.parameters(), lr=float(cfg["learning_rate"]), weight_decay=0.1, betas=(0.9, 0.95))
    batch = int(cfg["batch_size"])

    def sample_batch(src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start = torch.randint(0, len(src) - context - 1, (batch,), generator=gen)
        x = torch.stack([src[s : s + context] for s in start.tolist()])
        return x, torch.stack([src[s + 1 : s + context + 1] for s in start.tolist()])

    @torch.no_grad()
    def evaluate(src: torch.Tensor, batches: int = 8) -> float:
        model.eval()
        losses = [
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
            for x, y in (sample_batch(src if len(src) > context + 1 else train_data) for _ in range(batches))
        ]
        model.train()
        return sum(losses) / len(losses)

    steps = int(cfg["steps"])
    history = [{"step": 0, "train_loss": evaluate(train_data), "val_loss": evaluate(val_data)}]
    log(f"step 0: train loss {history[0]['train_loss']:.3f}, val loss {history[0]['val_loss']:.3f}")
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        lr = float(cfg["learning_rate"]) * min(1.0, step / max(1, steps // 10))  # linear warm-up
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = sample_batch(train_data)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % int(cfg["eval_interval"]) == 0 or step == steps:
            history.append({"step": step, "train_loss": evaluate(train_data), "val_loss": evaluate(val_data)})
            log(
                f"step {step}: train loss {history[-1]['train_loss']:.3f}, val loss {history[-1]['val_loss']:.3f} "
                f"({time.perf_counter() - t0:.0f} s)"
            )

    arch = DecoderArch(
        vocab_size=len(chars) + 2,
        hidden_size=d,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=d // heads,
        intermediate_size=4 * d,
        rms_norm_eps=1e-5,
        rope_theta=0.0,
        max_position_embeddings=context,
        tie_word_embeddings=True,
        eos_token_ids=(0,),
        family="gpt2",
        norm="layer",
        positions="learned",
        gated_mlp=False,
        activation="gelu_tanh",
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(model.hf_state_dict(), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(gpt2.to_hf_config(arch), indent=2))
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": EOS, "unk_token": UNK, "tokenizer_class": "PreTrainedTokenizerFast"})
    )
    (out_dir / "train_log.json").write_text(
        json.dumps({"text": str(path), "characters": len(text), "vocab": len(chars) + 2, "history": history}, indent=2)
    )
    return {"history": history, "checkpoint": str(out_dir)}
