"""What the engine runs on, chosen once when it is built: the attention and matmul backends (the native
kernels where they build and take the model's shapes, else torch's, with the reason), the KV pool's size,
static KV scales, and glibc's memory policy."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch

from toolkit.config import EngineConfig, host_memory_bytes
from toolkit.data import passages
from toolkit.engine.runner import ModelRunner
from toolkit.engine.scheduler import ScheduledBatch, ScheduledChunk
from toolkit.errors import ConfigError
from toolkit.kv import PagedKVCache
from toolkit.kv.quant import FORMATS, is_quantized
from toolkit.models import LoadedModel
from toolkit.native import gpu_attention, invariant_gpu
from toolkit.native.library import KernelUnavailable, native


@functools.cache
def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed blocks of up to 256 MB in the heap instead of unmapping them.
    Every step allocates and frees (rows x vocabulary) logits blocks and activations of several MB;
    returned to the kernel, each new one page-faults on first touch: at 64 rows this made the
    processors' elementwise ops 3-5x slower than in isolation (temperature 6 ms, masked_fill 8 ms a
    step on the EPYC). Other C libraries: nothing to do, False."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 256 << 20)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):
        return False


def attention_backend(cfg: EngineConfig, loaded: LoadedModel) -> str:
    """auto: the native kernel on CPU fp32 when it builds here and takes the model's shapes, else torch's
    sdpa path (one warning line on stderr when the kernels do not build: toolkit.native.library.native)."""
    wanted = cfg.attention_backend
    if wanted == "flex" and cfg.kv_cache_dtype != "auto":
        raise ConfigError(
            f"engine.attention_backend=flex reads the cache as stored; use engine.kv_cache_dtype=auto "
            f"or attention_backend=sdpa with kv_cache_dtype={cfg.kv_cache_dtype}"
        )
    if wanted in ("sdpa", "flex"):
        return wanted
    problem = None
    arch = loaded.arch
    unsupported = arch.needs_torch_attention
    if unsupported:
        problem = f"the native kernel has no {unsupported} ({arch.family})"
    elif cfg.kv_cache_dtype not in ("auto", "bf16") and cfg.kv_scale_granularity == "channel":
        problem = "the native kernel reads block or tensor scales, not engine.kv_scale_granularity=channel"
    elif torch.device(cfg.device).type == "cuda":  # the Triton kernel (toolkit/native/gpu_attention.py)
        problem = gpu_kernel_problem(cfg, arch)
    elif torch.device(cfg.device).type != "cpu":
        problem = "the native kernel runs on the CPU, and in Triton on a CUDA GPU"
    else:
        try:
            lib = native()
        except KernelUnavailable as exc:
            problem = str(exc)
        else:
            # a cache other than fp32 (8-bit, or 16-bit: kv_cache_dtype=bf16 or a bf16 / fp16 model's) takes
            # the kernel's vector path only
            vector_only = cfg.kv_cache_dtype != "auto" or loaded.model.embed.dtype != torch.float32
            if not lib.attention_supports(
                arch.num_heads, arch.num_kv_heads, arch.head_dim, cfg.block_size, vector_only
            ):
                problem = (
                    f"the native kernel reads an 8- or 16-bit cache at head_dim 64 or 128 with <= 32 heads, "
                    f"not engine.kv_cache_dtype={cfg.kv_cache_dtype} at head_dim {arch.head_dim} with "
                    f"{arch.num_heads} heads (a {str(loaded.model.embed.dtype).removeprefix('torch.')} model)"
                    if vector_only
                    else f"the native kernel takes head_dim <= 256, <= 32 query heads per KV head and "
                    f"engine.block_size <= 64, not head_dim {arch.head_dim}, {arch.num_heads} heads over "
                    f"{arch.num_kv_heads} KV heads, block_size {cfg.block_size}"
                )
    return _native_or_fallback(cfg, "attention_backend", wanted, ("kernel", "sdpa"), problem)


def gpu_kernel_problem(cfg: EngineConfig, arch) -> str | None:
    """Why the Triton paged attention cannot run this engine on a CUDA GPU (None: it can)."""
    if invariant_gpu.triton is None:
        return "Triton does not import here"
    if not gpu_attention.supports_attention(arch.head_dim, arch.num_heads // arch.num_kv_heads):
        return f"the GPU kernel takes a head_dim up to {gpu_attention.MAX_HEAD_DIM}, not head_dim {arch.head_dim}"
    return None


def graph_mode(cfg: EngineConfig, attention: str) -> str:
    """How decode steps run (toolkit/engine/graphs.py): "capture" (engine.cuda_graphs=auto on CUDA), "eager"
    (cuda_graphs=eager: the buckets without capture; auto on CUDA with an 8-bit cache's running block or channel
    scales) or "off" (cuda_graphs=off, auto elsewhere, and FlexAttention, whose block masks the runner builds per
    step)."""
    if attention == "flex" and cfg.cuda_graphs == "eager":
        raise ConfigError(
            "engine.cuda_graphs=eager runs the sdpa or kernel attention; attention_backend=flex "
            "builds its block masks per step: use cuda_graphs=off or auto"
        )
    if attention == "flex" or cfg.cuda_graphs == "off":
        return "off"
    if cfg.cuda_graphs == "eager":
        return "eager"
    if torch.device(cfg.device).type != "cuda":
        return "off"
    if is_quantized(cfg.kv_cache_dtype) and cfg.kv_scale_granularity != "tensor":
        # a running scale's writes find the blocks a step touches and those whose range grew (unique, any): a
        # capture of them fails, so the buckets run eagerly from the start (tensor scales are static: captured)
        return "eager"
    return "capture"


def matmul_backend(cfg: EngineConfig, loaded: LoadedModel) -> str:
    """auto: the native packed matmul on the CPU (fp32, or bf16 / fp16 weights widened as they are read, fp32
    sums) when the kernels build (faster than torch's GEMM at every step size measured here, see README
    "Benchmark"), else torch's. On a CUDA GPU "native" is the fixed-tiling Triton matmul, taken when asked for or
    when engine.batch_invariant needs it; auto there is cuBLAS."""
    wanted = "native" if cfg.batch_invariant else cfg.matmul_backend
    if wanted == "torch":
        return "torch"
    problem = None
    if torch.device(cfg.device).type == "cuda":  # the fixed-tiling Triton matmul, asked for or needed only
        if wanted == "auto":
            return "torch"  # cuBLAS: faster than one fixed tiling (docs/gpu.md)
        if invariant_gpu.triton is None:
            problem = "Triton does not import here"
    elif torch.device(cfg.device).type != "cpu":
        problem = "the native matmul runs on the CPU, and in Triton on a CUDA GPU"
    else:
        try:
            native()
        except KernelUnavailable as exc:
            problem = str(exc)
    return _native_or_fallback(cfg, "matmul_backend", wanted, ("native", "torch"), problem)


def _native_or_fallback(
    cfg: EngineConfig, option: str, wanted: str, names: tuple[str, str], problem: str | None
) -> str:
    """The native choice where nothing stands in its way; else the torch one, unless the native one was
    asked for (engine.<option>, or batch_invariant, which needs it): then a one-line error with the cause."""
    native_name, fallback = names
    if problem is None:
        return native_name
    if cfg.batch_invariant:
        raise ConfigError(f"engine.batch_invariant=true is unavailable here: {problem}")
    if wanted == native_name:
        raise ConfigError(f"engine.{option}={native_name} is unavailable: {problem}")
    return fallback


def kv_pool(cfg: EngineConfig, loaded: LoadedModel, max_model_len: int, scratch: bool) -> tuple[PagedKVCache, int, int]:
    """The engine's KV cache, its number of usable blocks (engine.num_kv_blocks, or what
    engine.kv_cache_memory_gb holds) and of host blocks (swap preemption); with `scratch`, one block more that
    padded rows of a CUDA graph write to. A per-tensor quantised cache is calibrated here."""
    layers, kv_heads, head_dim = loaded.model.kv_shape
    dtype = loaded.model.embed.dtype
    block_bytes = PagedKVCache.block_bytes(
        layers, cfg.block_size, kv_heads, head_dim, dtype, cfg.kv_cache_dtype, cfg.kv_scale_granularity
    )
    check_device(cfg)
    num_blocks = cfg.num_kv_blocks or auto_num_blocks(cfg, max_model_len, block_bytes)
    num_host_blocks = int(cfg.swap_space_gb * 2**30 // block_bytes) if cfg.preemption_mode == "swap" else 0
    for name, value, size, device in (
        ("num_kv_blocks", cfg.num_kv_blocks, num_blocks * block_bytes, torch.device(cfg.device)),
        ("swap_space_gb", cfg.swap_space_gb, num_host_blocks * block_bytes, torch.device("cpu")),
    ):
        total = memory_bytes(device)
        if size > total:  # refused here, not by the allocator's traceback (or a kill for the memory)
            if value is None:  # the pool sized itself: at least one block of this size did not fit
                name, value = "block_size", cfg.block_size
            raise ConfigError(
                f"engine.{name}={value:g} makes a KV pool of {size / 2**30:.1f} GB, more than the "
                f"{total / 2**30:.1f} GB of memory {device.type} has; lower it"
            )
    ram = memory_bytes(torch.device("cpu"))
    if torch.device(cfg.device).type != "cuda" and (num_blocks + num_host_blocks) * block_bytes > ram:
        raise ConfigError(  # both pools in RAM: each may fit, and not the two
            f"engine.num_kv_blocks and engine.swap_space_gb make KV pools of "
            f"{(num_blocks + num_host_blocks) * block_bytes / 2**30:.1f} GB together, more than the "
            f"{ram / 2**30:.1f} GB of memory cpu has; lower either"
        )
    kv_cache = PagedKVCache(
        layers,
        num_blocks + scratch,
        cfg.block_size,
        kv_heads,
        head_dim,
        dtype=dtype,
        device=torch.device(cfg.device),
        num_host_blocks=num_host_blocks,
        kv_dtype=cfg.kv_cache_dtype,
        granularity=cfg.kv_scale_granularity,
    )
    if kv_cache.granularity == "tensor":
        calibrate_kv_scales(kv_cache, loaded, cfg, max_model_len)
    return kv_cache, num_blocks, num_host_blocks


def context_scale(cfg: EngineConfig, arch) -> int | None:
    """engine.dynamic_chunking as the scheduler's chunk_cost takes it: None (off), or the context length at which a
    token's attention (4 FLOPs a query head's channel and position) costs as much as its layer's matmuls (2 a
    weight). auto counts those from the model's shape alone, so that every machine makes the same chunks and a
    replay the same steps (SmolLM2: 3,072; sliding-window layers are counted as whole-context ones). A CPU's
    attention runs at a lower share of its peak than its matmuls, so a chunk costs it more than this counts."""
    value = cfg.dynamic_chunking
    if value is None or value is False or value == "off":
        return None
    if value != "auto":
        return value
    q, kv, d = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.hidden_size
    weights = d * (q + 2 * kv) + q * d + (3 if arch.gated_mlp else 2) * d * arch.intermediate_size
    return max(1, weights // (2 * q))


def check_device(cfg: EngineConfig) -> None:
    """A ConfigError naming engine.device when this torch build or machine has no such device, or
    engine.kv_cache_memory_gb when it is more memory than the device has (the pool would be killed for it)."""
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"engine.device={cfg.device} but CUDA is not available; use engine.device=cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"engine.device={cfg.device} but this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"engine.device={cfg.device} but this torch build cannot use MPS; use engine.device=cpu")
    if cfg.num_kv_blocks is None:  # the pool is sized from kv_cache_memory_gb
        total = memory_bytes(device)
        if cfg.kv_cache_memory_gb * 2**30 > total:
            raise ConfigError(
                f"engine.kv_cache_memory_gb={cfg.kv_cache_memory_gb:g} is more than the {total / 2**30:.1f} GB "
                f"of memory {cfg.device} has; lower it"
            )


def memory_bytes(device: torch.device) -> int:
    """A device's memory: a CUDA GPU's, else this machine's RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return host_memory_bytes()


def auto_num_blocks(cfg: EngineConfig, max_model_len: int, block_bytes: int) -> int:
    """As many blocks as engine.kv_cache_memory_gb holds, but no more than max_num_seqs full-length
    sequences could ever use."""
    budget = int(cfg.kv_cache_memory_gb * 2**30 // block_bytes)
    useful = cfg.max_num_seqs * -(-max_model_len // cfg.block_size)
    return max(1, min(budget, useful))


def calibrate_kv_scales(kv_cache: PagedKVCache, loaded: LoadedModel, cfg: EngineConfig, max_model_len: int) -> None:
    """Static per-tensor KV scales from one prefill of a fixed calibration text in full precision
    (the built-in passages, or fixed ids without a tokenizer): the same scales on every run."""
    length = min(512, max_model_len)
    ids = (
        loaded.tokenizer.encode(" ".join(passages()), add_special_tokens=False)[:length]
        if loaded.tokenizer
        else [(7 * i + 3) % loaded.arch.vocab_size for i in range(length)]
    )
    layers, kv_heads, head_dim = loaded.model.kv_shape
    blocks = -(-len(ids) // cfg.block_size)
    probe = PagedKVCache(
        layers, blocks, cfg.block_size, kv_heads, head_dim, loaded.model.embed.dtype, torch.device(cfg.device)
    )
    chunk = ScheduledChunk("calibration", tuple(ids), 0, tuple(range(blocks)), samples=True, num_logits=1)
    ModelRunner(loaded.model, probe, torch.device(cfg.device), "sdpa").run(
        ScheduledBatch(step=0, chunks=(chunk,), num_decode_tokens=0, num_prefill_tokens=len(ids))
    )
    used = [(k.flatten(0, 1)[: len(ids)], v.flatten(0, 1)[: len(ids)]) for k, v in probe.layers]
    kv_cache.calibrate(used, FORMATS[cfg.kv_cache_dtype][1])
