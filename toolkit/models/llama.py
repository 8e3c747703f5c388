"""Llama-family decoder (SmolLM2, Llama 2/3, TinyLlama...) over a flat packed batch.

References: Touvron et al. 2023 (Llama); Su et al. 2021 (RoPE); Ainslie et al. 2023 (GQA);
Shazeer 2020 (SwiGLU). The weights are HF transformers' LlamaForCausalLM weights; the
projections are fused at load (q|k|v and gate|up) so a layer runs four GEMMs.

The forward takes one step's tokens packed along N (no padding, no separate prefill and
decode calls), writes their K/V into the paged cache and attends through it. Only the rows
that will be sampled go through the final norm and the LM head.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from toolkit.attention import AttentionMetadata, paged_attention, write_kv
from toolkit.errors import ModelLoadError


@dataclass(frozen=True)
class LlamaArch:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> "LlamaArch":
        model_type = cfg.get("model_type")
        if model_type not in ("llama", "mistral"):
            raise ModelLoadError(f"unsupported model_type {model_type!r}: this engine runs the Llama family")
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type != "default":
            raise ModelLoadError(f"unsupported rope_type {rope_type!r}; supported: default")
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ModelLoadError("Llama checkpoints with attention_bias or mlp_bias are not supported")
        if cfg.get("sliding_window"):
            raise ModelLoadError("sliding-window attention is not supported")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A config.json that HF's LlamaForCausalLM reads back to the same architecture."""
        d = asdict(self)
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": d["vocab_size"],
            "hidden_size": d["hidden_size"],
            "num_hidden_layers": d["num_layers"],
            "num_attention_heads": d["num_heads"],
            "num_key_value_heads": d["num_kv_heads"],
            "head_dim": d["head_dim"],
            "intermediate_size": d["intermediate_size"],
            "rms_norm_eps": d["rms_norm_eps"],
            "rope_theta": d["rope_theta"],
            "rope_parameters": {"rope_type": "default", "rope_theta": d["rope_theta"]},
            "max_position_embeddings": d["max_position_embeddings"],
            "tie_word_embeddings": d["tie_word_embeddings"],
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "eos_token_id": list(self.eos_token_ids) or None,
            "torch_dtype": "float32",
        }


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, then scaled by the learned weight (bit-equal to HF's on fp32 inputs, one fused op)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_tables(arch: LlamaArch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for every position, (max_pos, head_dim) fp32, computed as HF computes them."""
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    positions = torch.arange(arch.max_position_embeddings, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # (P, dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (P, dim)
    return emb.cos().to(device), emb.sin().to(device)


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous(), requires_grad=False)


def _frozen_t(t: torch.Tensor) -> nn.Parameter:
    """A projection stored as (in, out): `x @ w` beats `F.linear(x, w_out_in)` 2-4x on CPU at small M."""
    return nn.Parameter(t.t().contiguous(), requires_grad=False)


class LlamaLayer(nn.Module):
    def __init__(self, arch: LlamaArch, sd: Mapping[str, torch.Tensor], i: int):
        super().__init__()
        p = f"model.layers.{i}."
        a = p + "self_attn."
        self.w_qkv = _frozen_t(torch.cat([sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"]]))
        self.w_o = _frozen_t(sd[a + "o_proj.weight"])
        self.w_gate_up = _frozen_t(torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]))
        self.w_down = _frozen_t(sd[p + "mlp.down_proj.weight"])
        self.ln_attn = _frozen(sd[p + "input_layernorm.weight"])
        self.ln_mlp = _frozen(sd[p + "post_attention_layernorm.weight"])


class LlamaForPagedLM(nn.Module):
    """Llama decoder whose forward runs one engine step over the paged KV cache."""

    def __init__(self, arch: LlamaArch, state_dict: Mapping[str, torch.Tensor]):
        super().__init__()
        self.arch = arch
        missing = [k for k in _required_keys(arch) if k not in state_dict]
        if missing:
            raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[0]}")
        self.embed = _frozen(state_dict["model.embed_tokens.weight"])  # (V, hidden): rows are looked up
        self.layers = nn.ModuleList(LlamaLayer(arch, state_dict, i) for i in range(arch.num_layers))
        self.norm = _frozen(state_dict["model.norm.weight"])
        head = state_dict["model.embed_tokens.weight"] if arch.tie_word_embeddings else state_dict["lm_head.weight"]
        self.lm_head_t = _frozen_t(head)  # (hidden, V)
        cos, sin = rope_tables(arch, torch.device("cpu"))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.scale = arch.head_dim ** -0.5
        self._packed = None  # the projections packed for the native matmul (packed_weights)

    def packed_weights(self):
        """The projections packed for the native matmul, made on first use (a second copy of
        the weights, held only by models that run with engine.matmul_backend=native)."""
        if self._packed is None:
            from toolkit.kernels import pack_weight

            layers = [tuple(pack_weight(w) for w in (l.w_qkv, l.w_o, l.w_gate_up, l.w_down)) for l in self.layers]
            self._packed = (layers, pack_weight(self.lm_head_t))
        return self._packed

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(layers, kv heads, head dim) of the cache this model needs."""
        return self.arch.num_layers, self.arch.num_kv_heads, self.arch.head_dim

    @torch.inference_mode()
    def forward(self, input_ids_N: torch.Tensor, positions_N: torch.Tensor, attn: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], logits_rows_R: torch.Tensor,
                num_layers: int | None = None, native_matmul: bool = False) -> torch.Tensor:
        """Run one packed step; return fp32 logits (R, V) for the rows in `logits_rows_R`.

        `num_layers` stops after the first layers (then the final norm and LM head): the
        self-draft model of speculative decoding, sharing every weight with this one.
        `native_matmul` computes every projection with the packed fixed-order matmul (faster
        than torch's CPU GEMM here, and each row's bits are independent of the other rows,
        which the batch-invariant mode needs); the rest of the forward is per-token already."""
        a = self.arch
        mm, layer_weights, head = torch.matmul, None, self.lm_head_t
        if native_matmul:
            from toolkit.kernels import matmul_invariant as mm

            layer_weights, head = self.packed_weights()
        n = input_ids_N.shape[0]
        q_width, kv_width = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        cos = self.rope_cos[positions_N].unsqueeze(1).to(self.embed.dtype)  # (N, 1, Dh)
        sin = self.rope_sin[positions_N].unsqueeze(1).to(self.embed.dtype)
        x = self.embed[input_ids_N]  # (N, hidden)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers[:num_layers], kv_caches)):
            w_qkv, w_o, w_gate_up, w_down = layer_weights[i] if layer_weights else (
                layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down)
            h = rms_norm(x, layer.ln_attn, a.rms_norm_eps)
            qkv = mm(h, w_qkv)  # (N, (H + 2K) * Dh)
            qk = qkv[:, : q_width + kv_width].view(n, a.num_heads + a.num_kv_heads, a.head_dim)
            qk = qk * cos + rotate_half(qk) * sin  # RoPE on q and k heads at once
            q = qk[:, : a.num_heads]  # (N, H, Dh)
            k = qk[:, a.num_heads:]  # (N, K, Dh)
            v = qkv[:, q_width + kv_width:].view(n, a.num_kv_heads, a.head_dim)
            write_kv(k_cache, v_cache, k, v, attn.slot_mapping_N)
            o = paged_attention(q, k_cache, v_cache, attn, self.scale)  # (N, H, Dh)
            x = x + mm(o.reshape(n, q_width), w_o)
            h = rms_norm(x, layer.ln_mlp, a.rms_norm_eps)
            gate, up = mm(h, w_gate_up).chunk(2, dim=-1)
            x = x + mm(F.silu(gate) * up, w_down)
        h = rms_norm(x[logits_rows_R], self.norm, a.rms_norm_eps)
        return mm(h, head).float()  # (R, V)


def _required_keys(arch: LlamaArch) -> list[str]:
    keys = ["model.embed_tokens.weight", "model.norm.weight"]
    if not arch.tie_word_embeddings:
        keys.append("lm_head.weight")
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        keys += [p + s for s in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                 "mlp.down_proj.weight", "input_layernorm.weight",
                                 "post_attention_layernorm.weight")]
    return keys
