"""The decoder every model family runs on: one forward over a flat packed batch and the paged cache.

A family (toolkit/models/<family>.py) reads its HF config into a `DecoderArch` and renames its
checkpoint's tensors into the canonical names below; `PagedDecoder` then runs them. The
options cover the decoder-only families of the last few years:

- positions: rotary (Su et al. 2021) or learned absolute (GPT-2);
- norms: RMSNorm or LayerNorm with bias; Gemma2's extra norms after attention and MLP;
- projections: fused q|k|v with optional bias (Qwen2, GPT-2), optional output bias;
  per-head RMSNorm of q and k before RoPE (Qwen3);
- MLP: gated (SwiGLU / GeGLU: Llama, Qwen, Gemma2) or plain with biases (GPT-2);
- Gemma2: scaled embeddings, attention-logit and final-logit soft-capping, sliding-window
  attention on alternating layers, query scale from `query_pre_attn_scalar`.

Canonical tensor names (projections in torch's Linear orientation, (out, in)):
`embed`, `pos_embed`, `norm`, `norm_b`, `lm_head`, and per layer `layers.{i}.` +
`ln_attn ln_attn_b w_qkv b_qkv q_norm k_norm w_o b_o post_attn_norm ln_mlp ln_mlp_b
w_gate_up w_up b_up w_down b_down post_mlp_norm` (each family uses the ones it has).
Only the rows that will be sampled go through the final norm and the LM head.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from toolkit.errors import ModelLoadError
from toolkit.kv.attention import AttentionMetadata, paged_attention, write_kv
from toolkit.native import gpu_matmul as gm
from toolkit.native import invariant_gpu, library
from toolkit.native.library import NativeLib
from toolkit.native.ops import (
    add_rms_norm_cpu,
    decoder_layers_cpu,
    matmul_invariant,
    packed_arena,
    rope_cpu,
    silu_mul_cpu,
)
from toolkit.native.schedules import MatmulSchedule

ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}
# torch's CPU elementwise loops take a tensor in a vector body and a scalar tail, whose tanh, erf and exp round
# differently, and GELU splits more than 16384 elements over the threads: a row's activation had other bits where
# the row sat elsewhere in the batch (GPT-2 at an MLP width no multiple of the loop's step, 240 on AVX-512). A row at
# a time, in pieces of at most this many elements (one thread each), each row has its own.
ROW_PIECE = 16384


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x_NW: torch.Tensor) -> torch.Tensor:
    """fn(x_NW) computed a row at a time (in pieces of ROW_PIECE elements): a row's bits whatever the other rows."""
    n, w = x_NW.shape
    if n == 1 and w <= ROW_PIECE:
        return fn(x_NW)
    out = torch.empty((n, w), dtype=x_NW.dtype, device=x_NW.device)
    for i in range(n):
        for j in range(0, w, ROW_PIECE):
            out[i : i + 1, j : j + ROW_PIECE] = fn(x_NW[i : i + 1, j : j + ROW_PIECE])
    return out


@dataclass(frozen=True)
class DecoderArch:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float  # the eps of every norm (RMSNorm or LayerNorm)
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()
    family: str = "llama"
    norm: str = "rms"  # rms | layer
    positions: str = "rope"  # rope | learned
    gated_mlp: bool = True
    activation: str = "silu"  # silu | gelu_tanh | gelu
    qk_norm: bool = False
    sandwich_norm: bool = False  # Gemma2: norms after attention and after the MLP too
    embed_scale: float = 1.0
    query_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()  # layers that attend to the last `sliding_window` keys only

    @property
    def scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    def window_of(self, layer: int) -> int | None:
        return self.sliding_window if layer in self.sliding_layers else None

    @property
    def needs_torch_attention(self) -> str | None:
        """Why the native attention kernel cannot run this model (None: it can)."""
        if self.attn_softcap is not None:
            return "attention-logit soft-capping"
        if self.sliding_layers:
            return "sliding-window layers"
        return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, then scaled by the learned weight: bit-equal to HF's LlamaRMSNorm on the CPU, in one fused
    op for fp32 inputs. A 16-bit input is normalised in fp32 by the same fused op, rounded to its format, then
    scaled, as HF does (HF spells the fp32 part as five ops: pow, mean, add, rsqrt, mul; four kernels a norm
    more, ~240 a SmolLM2 step on a GPU, where a 16-bit step was slower than fp32's)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_tables(arch: DecoderArch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
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


PROJECTIONS = ("w_qkv", "w_o", "w_gate_up", "w_up", "w_down")
VECTORS = (
    "ln_attn",
    "ln_attn_b",
    "b_qkv",
    "q_norm",
    "k_norm",
    "b_o",
    "post_attn_norm",
    "ln_mlp",
    "ln_mlp_b",
    "b_up",
    "b_down",
    "post_mlp_norm",
)


class DecoderLayer(nn.Module):
    def __init__(self, sd: Mapping[str, torch.Tensor], i: int):
        super().__init__()
        p = f"layers.{i}."
        self.projections = tuple(n for n in PROJECTIONS if p + n in sd)  # in forward order
        for name in self.projections:
            setattr(self, name, _frozen_t(sd[p + name]))
        for name in VECTORS:
            setattr(self, name, _frozen(sd[p + name]) if p + name in sd else None)


class PagedDecoder(nn.Module):
    """A decoder whose forward runs one engine step over the paged KV cache."""

    def __init__(self, arch: DecoderArch, sd: Mapping[str, torch.Tensor]):
        super().__init__()
        self.arch = arch
        missing = [k for k in required_keys(arch) if k not in sd]
        if missing:
            raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[0]}")
        self.embed = _frozen(sd["embed"])  # (V, hidden): rows are looked up
        self.pos_embed = _frozen(sd["pos_embed"]) if arch.positions == "learned" else None
        self.layers = nn.ModuleList(DecoderLayer(sd, i) for i in range(arch.num_layers))
        self.norm = _frozen(sd["norm"])
        self.norm_b = _frozen(sd["norm_b"]) if "norm_b" in sd else None
        self.lm_head_t = _frozen_t(sd["embed"] if arch.tie_word_embeddings else sd["lm_head"])  # (hidden, V)
        if arch.positions == "rope":
            cos, sin = rope_tables(arch, torch.device("cpu"))
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.scale = arch.scale
        self._packed: dict[str, tuple] = {}  # the projections packed for the native matmul, by build (packed_weights)
        self.act = ACTIVATIONS[arch.activation]
        # whether every layer is plain Llama (no biases, q/k norms or extra norms, no soft-capping or
        # sliding window): then a CPU fp32 step on the native kernels runs all layers in one C call
        self._plain = (
            arch.norm == "rms"
            and arch.attn_softcap is None
            and all(
                arch.window_of(i) is None
                and all(getattr(layer, n) is None for n in VECTORS if n not in ("ln_attn", "ln_mlp"))
                for i, layer in enumerate(self.layers)
            )
        )
        self.fused_layers = True  # may be switched off per model (tests compare both paths bit for bit)
        self._layer_weights: dict[str, list] = {}  # the packed weights' addresses per layer, for the fused call
        self._norms_f32 = None  # the norm weights in fp32 (a 16-bit model's widened) the fused call reads
        self._layer_tables: dict[tuple[int, ...], torch.Tensor] = {}  # with the caches' addresses

    def packed_weights(self, lib: NativeLib | None = None):
        """The projections packed for `lib`'s native matmul (default: the process's build), made on first use: a
        copy of the weights (another where another build's matmul runs some rows: toolkit.native.schedules)."""
        key = build_key(lib)
        if key not in self._packed:  # one arena on huge pages, in the order a step reads them (packed_arena)
            weights = [getattr(layer, n) for layer in self.layers for n in layer.projections]
            packed = iter(packed_arena(weights + [self.lm_head_t], lib))
            layers = [{n: next(packed) for n in layer.projections} for layer in self.layers]
            self._packed[key] = (layers, next(packed))
        return self._packed[key]

    def packed_projections(self, lib: NativeLib | None = None):
        """packed_weights(lib) as one list, every layer's projections in order, and the LM head's."""
        layers, head = self.packed_weights(lib)
        return [w for layer in layers for w in layer.values()], head

    def drop_packed(self, keep: list[str]) -> None:
        """Release the packings for other builds than the process's own and those named in `keep`."""
        for key in [k for k in self._packed if k and k not in keep]:
            del self._packed[key]
            self._layer_weights.pop(key, None)
        self._layer_tables.clear()

    @staticmethod
    def _native(x: torch.Tensor) -> bool:
        """Whether CPU activations go through the native kernels (RoPE, bit-identical to the torch
        expression in fp32; residual add + RMSNorm and SiLU * up, each one pass; all layers in one call):
        where they build (toolkit.native.library.native) and are not switched off. bf16 / fp16 activations too:
        each kernel computes in fp32 and rounds its outputs to the model's format."""
        if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
        return library.available()

    def _head_norm(self, x_NHD: torch.Tensor, weight: torch.Tensor, gpu: bool) -> torch.Tensor:
        """RMSNorm of each head (Qwen3's q and k norms); on a GPU one Triton program a head, as batch-invariant as
        the rest of the step."""
        if gpu:
            n, heads, dim = x_NHD.shape
            return invariant_gpu.rms_norm(x_NHD.reshape(n * heads, dim), weight, self.arch.rms_norm_eps).view(
                n, heads, dim
            )
        return rms_norm(x_NHD, weight, self.arch.rms_norm_eps)

    def _add_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        native: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, norm of it); natively in one pass that updates x (an activation this forward owns), or
        on a CUDA GPU in one Triton kernel (the same order: the sum rounded to the format, then HF's RMSNorm)."""
        if native:
            return add_rms_norm_cpu(x, residual, weight, self.arch.rms_norm_eps)
        if self.arch.norm == "rms" and invariant_gpu.routes(x):
            return invariant_gpu.add_rms_norm(x, residual, weight, self.arch.rms_norm_eps)
        if residual is not None:
            x = x + residual
        return x, self._norm(x, weight, bias)

    def _fused(self, x: torch.Tensor, attn: AttentionMetadata, kv_caches, positions_N: torch.Tensor) -> bool:
        """Whether this step's layers run in one native call (csrc/decoder_layers.c): a plain Llama on the CPU
        (the caller checks the native matmul, RoPE, norm and SiLU kernels apply), every row through the
        attention kernel, a cache in the model's format (fp32, bf16 or fp16)."""
        n = positions_N.shape[0]
        return (
            self.fused_layers
            and self._plain
            and n > 0
            and attn.flex is None
            and attn.kv_quant is None
            and attn.kernel_rows == n
            and kv_caches[0][0].dtype == x.dtype
            and all(
                t.dtype == torch.int64 and t.is_contiguous()
                for t in (positions_N, attn.slot_mapping_N, attn.query_table_N, attn.query_ctx_N, attn.block_tables_SB)
            )
            and self._native(x)
        )

    def _layer_table(self, kv_caches, num_layers: int, lib: NativeLib | None = None) -> torch.Tensor:
        """Per layer: the addresses of its norm weights (fp32: a 16-bit model's widened, kept here), packed
        projections (packed for `lib`'s matmul; None, the process's own build's) and K / V caches."""
        build = build_key(lib)
        if self._norms_f32 is None:
            self._norms_f32 = [(layer.ln_attn.float(), layer.ln_mlp.float()) for layer in self.layers]
        if build not in self._layer_weights:
            self._layer_weights[build] = [
                [a.data_ptr(), b.data_ptr()]
                + [p[name].data.data_ptr() for name in ("w_qkv", "w_o", "w_gate_up", "w_down")]
                for (a, b), p in zip(self._norms_f32, self.packed_weights(lib)[0])
            ]
        caches = tuple(p for k, v in kv_caches[:num_layers] for p in (k.data_ptr(), v.data_ptr()))
        table = self._layer_tables.get((build, caches))
        if table is None:  # built once per cache and build (and per depth, for the self-draft)
            if len(self._layer_tables) >= 8:
                self._layer_tables.clear()
            weights = self._layer_weights[build][:num_layers]
            table = torch.tensor(
                [w + [k, v] for w, k, v in zip(weights, caches[0::2], caches[1::2])], dtype=torch.int64
            )
            self._layer_tables[(build, caches)] = table
        return table

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(layers, kv heads, head dim) of the cache this model needs."""
        return self.arch.num_layers, self.arch.num_kv_heads, self.arch.head_dim

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.arch.norm == "layer":
            return F.layer_norm(x, (x.shape[-1],), weight, bias, self.arch.rms_norm_eps)
        return rms_norm(x, weight, self.arch.rms_norm_eps)

    @torch.inference_mode()
    def forward(
        self,
        input_ids_N: torch.Tensor,
        positions_N: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_rows_R: torch.Tensor,
        num_layers: int | None = None,
        native_matmul: bool = False,
        schedule: MatmulSchedule | None = None,
        batch_invariant: bool = False,
    ) -> torch.Tensor:
        """Run one packed step; return fp32 logits (R, V) for the rows in `logits_rows_R`. `num_layers` stops after
        the first layers (then the final norm and LM head): the self-draft of speculative decoding, sharing every weight.
        `native_matmul` computes every projection with the packed fixed-order matmul (faster than torch's CPU GEMM
        here, and each row's bits are independent of the other rows, which the batch-invariant mode needs); `schedule`:
        its loops for each number of rows (toolkit.native.schedules: the same bits in every one). `batch_invariant`
        (that mode): an activation without a native kernel runs a row at a time on the CPU too (`rowwise`)."""
        a = self.arch
        mm, packed, head = torch.matmul, None, self.lm_head_t
        n = input_ids_N.shape[0]
        if native_matmul and invariant_gpu.routes(self.embed):  # one fixed tiling, no split-K: M changes no row

            def mm(h, w):
                return gm.invariant_matmul(h, w)
        elif native_matmul:
            plan = schedule or MatmulSchedule()
            mm_lib = plan.lib_for_rows(n)  # the build whose matmul runs the projections' n rows (None: our own)

            def mm(h, w):
                return matmul_invariant(h, w, mm_lib, schedule=plan.for_rows(h.shape[0]))

            packed, _ = self.packed_weights(mm_lib)
            head_lib = plan.lib_for_rows(logits_rows_R.shape[0])
            head = self.packed_weights(head_lib)[1]
        q_width, kv_width = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        x = self.embed[input_ids_N]  # (N, hidden)
        if a.embed_scale != 1.0:
            x = x * torch.tensor(a.embed_scale, dtype=x.dtype)
        native = self._native(x)
        native_rope = self.pos_embed is None and native
        native_norm = a.norm == "rms" and native
        native_silu = native_norm and a.gated_mlp and a.activation == "silu"
        # on a GPU, RMSNorm with the residual add, RoPE and SiLU * up are one Triton kernel each where torch spends 2-5
        # (a CUDA graph's length and launch time follow its kernel count)
        gpu = invariant_gpu.routes(x)
        gpu_rope = gpu and self.pos_embed is None
        gpu_silu = gpu and a.gated_mlp and a.activation == "silu"
        if self.pos_embed is not None:
            x = x + self.pos_embed[positions_N]
        elif not (native_rope or gpu_rope):
            cos = self.rope_cos[positions_N].unsqueeze(1).to(self.embed.dtype)  # (N, 1, Dh)
            sin = self.rope_sin[positions_N].unsqueeze(1).to(self.embed.dtype)
        act = functools.partial(rowwise, self.act) if batch_invariant and x.device.type == "cpu" else self.act
        pending = None  # the previous layer's MLP output: the next norm adds it to x
        layers = list(zip(itertools.islice(self.layers, num_layers), kv_caches))  # no ModuleList slice per step
        if native_matmul and native_silu and native_rope and self._fused(x, attn, kv_caches, positions_N):
            dims = (
                n,
                a.hidden_size,
                a.num_heads,
                a.num_kv_heads,
                a.head_dim,
                self.layers[0].w_down.shape[0],
                kv_caches[0][0].shape[1],
            )
            decoder_layers_cpu(
                x,
                self._layer_table(kv_caches, len(layers), mm_lib),
                dims,
                positions_N,
                attn.slot_mapping_N,
                self.rope_cos,
                self.rope_sin,
                attn.block_tables_SB,
                attn.query_table_N,
                attn.query_ctx_N,
                a.rms_norm_eps,
                self.scale,
                kv_caches[0][0].shape[0] * kv_caches[0][0].shape[1],
                schedule=plan.for_rows(n),
                matmul_lib=mm_lib,
            )
            layers = []  # x holds the last layer's residual stream, its MLP output added
        for i, (layer, (k_cache, v_cache)) in enumerate(layers):
            weights = packed[i] if packed else None

            def proj(h, name, bias=None):
                y = mm(h, weights[name] if weights else getattr(layer, name))
                return y if bias is None else y + bias

            x, h = self._add_norm(x, pending, layer.ln_attn, layer.ln_attn_b, native_norm)
            qkv = proj(h, "w_qkv", layer.b_qkv)  # (N, (H + 2K) * Dh)
            qk = qkv[:, : q_width + kv_width].view(n, a.num_heads + a.num_kv_heads, a.head_dim)
            if layer.q_norm is not None:  # Qwen3: RMSNorm of each q and k head before RoPE
                qk = torch.cat(
                    [
                        self._head_norm(qk[:, : a.num_heads], layer.q_norm, gpu),
                        self._head_norm(qk[:, a.num_heads :], layer.k_norm, gpu),
                    ],
                    dim=1,
                )
            v = qkv[:, q_width + kv_width :].view(n, a.num_kv_heads, a.head_dim)
            if gpu_rope and attn.kv_quant is None:  # RoPE and the cache writes in one kernel, the same bits
                q = invariant_gpu.rope_write_kv(
                    qk, v, self.rope_cos, self.rope_sin, positions_N, k_cache, v_cache, attn.slot_mapping_N
                )
            else:
                if native_rope:  # the same bits in one pass
                    qk = rope_cpu(qk, self.rope_cos, self.rope_sin, positions_N)
                elif gpu_rope:  # the same bits in one kernel
                    qk = invariant_gpu.rope(qk, self.rope_cos, self.rope_sin, positions_N)
                elif self.pos_embed is None:
                    qk = qk * cos + rotate_half(qk) * sin  # RoPE on q and k heads at once
                q = qk[:, : a.num_heads]  # (N, H, Dh)
                write_kv(k_cache, v_cache, qk[:, a.num_heads :], v, attn.slot_mapping_N, attn.kv_quant, i)
            o = paged_attention(
                q, k_cache, v_cache, attn, self.scale, softcap=a.attn_softcap, window=a.window_of(i), layer=i
            )  # (N, H, Dh)
            o = proj(o.reshape(n, q_width), "w_o", layer.b_o)
            if layer.post_attn_norm is not None:
                o = self._norm(o, layer.post_attn_norm)
            x, h = self._add_norm(x, o, layer.ln_mlp, layer.ln_mlp_b, native_norm)
            if native_silu:
                h = silu_mul_cpu(proj(h, "w_gate_up"))
            elif gpu_silu:
                h = invariant_gpu.silu_mul(proj(h, "w_gate_up"))
            elif a.gated_mlp:
                gate, up = proj(h, "w_gate_up").chunk(2, dim=-1)
                h = act(gate) * up
            else:
                h = act(proj(h, "w_up", layer.b_up))
            m = proj(h, "w_down", layer.b_down)
            if layer.post_mlp_norm is not None:
                m = self._norm(m, layer.post_mlp_norm)
            pending = m
        if pending is not None:
            x = x + pending
        _, h = self._add_norm(x[logits_rows_R], None, self.norm, self.norm_b, native_norm)
        if packed is not None:  # the packed matmul gives a 16-bit model's logits as fp32 at once (the same bits)
            logits = matmul_invariant(h, head, head_lib, schedule=plan.for_rows(h.shape[0]), as_fp32=True)
        else:
            logits = mm(h, head).float()  # (R, V)
        if a.final_softcap is not None:
            logits = torch.tanh(logits / a.final_softcap) * a.final_softcap
        return logits


def build_key(lib: NativeLib | None) -> str:
    """A model's packings' and layer tables' key for a build: "" for the process's own, else its name."""
    return "" if lib is None or lib is library.resolve_or_none(None) else lib.profile.target


def required_keys(arch: DecoderArch) -> list[str]:
    keys = ["embed", "norm"] + ([] if arch.tie_word_embeddings else ["lm_head"])
    if arch.positions == "learned":
        keys.append("pos_embed")
    for i in range(arch.num_layers):
        p = f"layers.{i}."
        keys += [p + s for s in ("ln_attn", "w_qkv", "w_o", "ln_mlp", "w_down")]
        keys.append(p + ("w_gate_up" if arch.gated_mlp else "w_up"))
    return keys
