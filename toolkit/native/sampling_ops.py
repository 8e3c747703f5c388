"""The sampler's kernels as torch functions (toolkit.native.ops has the model's): a step's logits rows reduced,
truncated, noised and sampled in place, each call one symbol of the process's build (or the `lib` passed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from toolkit.native.library import NativeLib, resolve, resolve_or_none


class Patches(Protocol):
    """What the sampler's pass reads of a few per-row logit changes (toolkit.sampling.processors.base.Patches is one):
    entry k divides the logit at (rows_S[k], cols_S[k]) by factor_S[k] where it is not negative, else multiplies."""

    rows_S: torch.Tensor  # int64, non-decreasing
    cols_S: torch.Tensor  # int64
    factor_S: torch.Tensor

    def apply(self, x_RV: torch.Tensor) -> torch.Tensor: ...


def _rows_ok(x: torch.Tensor) -> bool:
    """A 2-D fp32 CPU tensor whose rows are contiguous: what the row-wise kernels read in place."""
    return x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(1) == 1


def logsumexp_cpu(x_RV: torch.Tensor, lib: NativeLib | None = None) -> torch.Tensor | None:
    """logsumexp of each row (R,) in one C pass per row, or None where the kernel does not apply."""
    lib = resolve_or_none(lib) if _rows_ok(x_RV) else None
    if lib is None:
        return None
    out = torch.empty(x_RV.shape[0], dtype=torch.float32)
    lib.fn["logsumexp"](
        x_RV.data_ptr(), x_RV.stride(0), x_RV.shape[0], x_RV.shape[1], out.data_ptr(), torch.get_num_threads()
    )
    return out


def argmax_cpu(x_RV: torch.Tensor, lib: NativeLib | None = None) -> list[int] | None:
    """torch.argmax(x, dim=-1) of each row (the first maximal index; a NaN counts as the maximum) in one
    C pass, or None where the kernel does not apply."""
    lib = resolve_or_none(lib) if _rows_ok(x_RV) and x_RV.shape[1] > 0 else None
    if lib is None:
        return None
    out = torch.empty(x_RV.shape[0], dtype=torch.int64)
    lib.fn["argmax"](
        x_RV.data_ptr(), x_RV.stride(0), x_RV.shape[0], x_RV.shape[1], out.data_ptr(), torch.get_num_threads()
    )
    return out.tolist()


FEW_ROWS = 8  # logprobs_at_cpu's rows at most, each read alone (past it torch's one gather is sooner)


def logprobs_at_cpu(x_RV: torch.Tensor, lse_R: torch.Tensor, tokens: list[int]) -> list[float] | None:
    """x[r, tokens[r]] - lse[r] for each row, an fp32 subtraction, for a few CPU fp32 rows read in place through
    numpy: the same bits as torch's gather and subtraction, without its four calls, each tens of microseconds on a
    decode step's path (the forward's weights have just pushed the host's code and data out of every cache).
    None where torch should take them (many rows, another format or device, a token outside the row)."""
    if not (
        len(tokens) <= FEW_ROWS
        and x_RV.dtype == lse_R.dtype == torch.float32
        and x_RV.device.type == lse_R.device.type == "cpu"
        and not (x_RV.requires_grad or lse_R.requires_grad)
        and all(0 <= t < x_RV.shape[1] for t in tokens)
    ):
        return None
    rows, lse = x_RV.numpy(), lse_R.numpy()
    with np.errstate(all="ignore"):  # inf - inf is NaN, as torch gives it, without numpy's warning
        return [float(rows[i, t] - lse[i]) for i, t in enumerate(tokens)]


def gumbel_sample_cpu(
    x_RV: torch.Tensor, keys: list[tuple[int, int] | None], lib: NativeLib | None = None
) -> tuple[list[int], list[float], list[int]] | None:
    """For each row: the Gumbel-max token over its finite logits under its key (None: not sampled,
    token -1), that token's noise (NaN where none) and the row's count of finite logits, all rows in
    one C call (toolkit/csrc/gumbel.c); None where the kernel does not apply."""
    lib = resolve_or_none(lib) if _rows_ok(x_RV) and x_RV.shape[1] < 2**31 else None
    if lib is None:
        return None
    n = x_RV.shape[0]
    keys_t = torch.tensor([k if k is not None else (0, 0) for k in keys], dtype=torch.int64).to(torch.int32)
    sampled = torch.tensor([k is not None for k in keys], dtype=torch.int8)
    tokens = torch.full((n,), -1, dtype=torch.int64)
    noise = torch.full((n,), float("nan"), dtype=torch.float64)
    support = torch.empty(n, dtype=torch.int64)
    if (
        lib.fn["gumbel_sample_rows"](
            x_RV.data_ptr(),
            x_RV.stride(0),
            x_RV.shape[1],
            n,
            keys_t.data_ptr(),
            sampled.data_ptr(),
            tokens.data_ptr(),
            noise.data_ptr(),
            support.data_ptr(),
            torch.get_num_threads(),
        )
        != 0
    ):
        raise MemoryError("gumbel_sample_rows: out of memory")
    return tokens.tolist(), noise.tolist(), support.tolist()


TRUNCATION_MODES = {"top_p": 0, "top_k": 1}


def truncate_cpu(
    x_RV: torch.Tensor, mode: str, param_R: torch.Tensor, lib: NativeLib | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """top-p (param p) or top-k (param k) of every row in one C call: (the rows with the logits below
    each row's threshold set to -inf, the thresholds), found by bisection over the logits' order
    (toolkit/csrc/gumbel.c); None where the kernel does not apply."""
    lib = resolve_or_none(lib) if _rows_ok(x_RV) and x_RV.shape[1] > 0 else None
    if lib is None:
        return None
    param_R = param_R.to(torch.float32).contiguous()
    out = torch.empty(x_RV.shape, dtype=torch.float32)
    thresholds = torch.empty(x_RV.shape[0], dtype=torch.float32)
    if (
        lib.fn["truncate"](
            x_RV.data_ptr(),
            x_RV.stride(0),
            x_RV.shape[0],
            x_RV.shape[1],
            TRUNCATION_MODES[mode],
            param_R.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            thresholds.data_ptr(),
            torch.get_num_threads(),
        )
        != 0
    ):
        raise MemoryError("truncate: out of memory")
    return out, thresholds


TAIL_OPS = {"top_p": 0, "top_k": 1, "temperature": 2}  # what toolkit_sample_tail_rows applies, per row, in order
TAIL_WIDTH = 3  # ops per row


def _tail_lib(x_RV: torch.Tensor, lib: NativeLib | None) -> NativeLib | None:
    return resolve_or_none(lib) if _rows_ok(x_RV) and 0 < x_RV.shape[1] < 2**31 else None


def tail_fusable(x_RV: torch.Tensor, lib: NativeLib | None = None) -> bool:
    """Whether `sample_tail_cpu` runs on these logits (fp32 CPU rows and a native build)."""
    return _tail_lib(x_RV, lib) is not None


@dataclass(frozen=True)
class TailSample:
    """What sample_tail_cpu returns: per row, the token (the Gumbel-max token where sampled, else the
    processed row's argmax), its noise (NaN where not sampled), the processed row's support (finite
    logits) and logsumexp, and the processed logit at the token; the processed rows where asked for."""

    tokens: list[int]
    noise: list[float]
    support: list[int]
    logsumexp_R: torch.Tensor
    picked_R: torch.Tensor
    processed_RV: torch.Tensor | None
    kept_bits_RB: torch.Tensor | None = None  # (R, ceil(V / 8)) uint8 kept masks of rows with support < V
    raw_logsumexp_R: torch.Tensor | None = None  # the input rows' logsumexp, where asked for


def sample_tail_cpu(
    x_RV: torch.Tensor,
    ops: list[tuple[tuple[str, float], ...]],
    keys: list[tuple[int, int] | None],
    keep_rows: bool = True,
    lib: NativeLib | None = None,
    patches: Patches | None = None,
    raw_logsumexp: bool = False,
) -> TailSample | None:
    """Each row through its ops ((name, value) in order: temperature, top_k, top_p, as the processors of
    those names compute them), then its support, logsumexp, and Gumbel-max token and noise under its key
    (None: not sampled, the argmax instead), in one C call that keeps each row in cache
    (toolkit/csrc/gumbel.c): the same bits as `truncate_cpu`, `logsumexp_cpu`, `gumbel_sample_cpu` and
    `argmax_cpu` one after another. `keep_rows=False` never writes the processed rows out (a write of the
    whole block saved); `patches` are made to each row before its ops (`patches.apply(x_RV)` as the
    input, without copying the block); `raw_logsumexp` also returns the input rows' logsumexp (logsumexp_cpu's
    bits), read while each row is in cache; None where the kernel does not apply."""
    call = TailCall.of(x_RV, ops, keys, keep_rows, lib, patches, raw_logsumexp)
    return call.result() if call is not None else None


class TailCall:
    """sample_tail_cpu in its three parts, so that a caller can put its Python beside other work: the
    arguments checked and laid out (`of`), the kernel's pass on every thread (`run`), and its TailSample
    (`result`). The input rows and patches must not change until the pass has run."""

    def __init__(
        self,
        lib: NativeLib,
        x_RV: torch.Tensor,
        ops: list[tuple[tuple[str, float], ...]],
        keys: list[tuple[int, int] | None],
        keep_rows: bool,
        patches: Patches | None,
        raw_logsumexp: bool,
    ):
        n, vocab = x_RV.shape
        # the rows' ops, encoded once per distinct tuple (a step's rows mostly share their parameters); the
        # small arrays in numpy (a torch.tensor of nested lists took ~10 us each, several times that cold)
        distinct: dict = {}
        which = [distinct.setdefault(row, len(distinct)) for row in ops]
        if any(len(row) > TAIL_WIDTH for row in distinct):
            raise ValueError(f"at most {TAIL_WIDTH} tail ops a row")
        pad = ((-1, 0.0),) * TAIL_WIDTH
        table = [[(TAIL_OPS[name], value) for name, value in row] + list(pad[len(row) :]) for row in distinct]
        codes = np.array([[code for code, _ in row] for row in table], np.int32)[which]
        values = np.array([[value for _, value in row] for row in table], np.float32)[which]
        keys_w = np.array([k if k is not None else (0, 0) for k in keys], np.uint32).reshape(n, 2)
        sampled = np.array([k is not None for k in keys], np.int8)
        self.out = torch.empty((n, vocab), dtype=torch.float32) if keep_rows else None
        self.lse, self.picked = np.empty(n, np.float32), np.empty(n, np.float32)
        self.raw_lse = np.empty(n, np.float32) if raw_logsumexp else None
        self.tokens, self.noise, self.support = np.empty(n, np.int64), np.empty(n, np.float64), np.empty(n, np.int64)
        self.kept = np.empty((n, (vocab + 7) // 8), np.uint8)  # filled only for rows with support < V
        patch = (None, None, None)
        if patches is not None and patches.rows_S.numel():
            # checked, host-side in numpy (a few hundred entries): the kernel writes where they say
            rows_S, cols_S = patches.rows_S.numpy(), patches.cols_S.numpy()
            if (
                rows_S[0] < 0
                or rows_S[-1] >= n
                or (rows_S[1:] < rows_S[:-1]).any()
                or cols_S.min() < 0
                or cols_S.max() >= vocab
            ):
                raise ValueError(f"patches must list rows in order within [0, {n}) and columns within [0, {vocab})")
            off = np.zeros(n + 1, np.int64)
            np.cumsum(np.bincount(rows_S, minlength=n), out=off[1:])
            patch = (off, cols_S.astype(np.int32), np.ascontiguousarray(patches.factor_S.to(torch.float32).numpy()))
        self._keep = (x_RV, codes, values, keys_w, sampled, patch)  # alive until the call returns
        self._args = (
            x_RV.data_ptr(),
            x_RV.stride(0),
            n,
            vocab,
            codes.ctypes.data,
            values.ctypes.data,
            *(a.ctypes.data if a is not None else None for a in patch),
            keys_w.ctypes.data,
            sampled.ctypes.data,
            self.out.data_ptr() if keep_rows else None,
            vocab,
            self.raw_lse.ctypes.data if raw_logsumexp else None,
            self.lse.ctypes.data,
            self.tokens.ctypes.data,
            self.noise.ctypes.data,
            self.support.ctypes.data,
            self.picked.ctypes.data,
            self.kept.ctypes.data,
            self.kept.shape[1],
            torch.get_num_threads(),
        )
        self._fn = lib.fn["sample_tail_rows"]
        self.done = False

    @classmethod
    def of(
        cls,
        x_RV: torch.Tensor,
        ops: list[tuple[tuple[str, float], ...]],
        keys: list[tuple[int, int] | None],
        keep_rows: bool = True,
        lib: NativeLib | None = None,
        patches: Patches | None = None,
        raw_logsumexp: bool = False,
    ) -> TailCall | None:
        """sample_tail_cpu's call for these arguments (see there), not yet run; None where the kernel does not
        apply."""
        lib = _tail_lib(x_RV, lib)
        return cls(lib, x_RV, ops, keys, keep_rows, patches, raw_logsumexp) if lib is not None else None

    def run(self) -> None:
        """The kernel's pass (once)."""
        if not self.done:
            if self._fn(*self._args) != 0:
                raise MemoryError("sample_tail_rows: out of memory")
            self.done = True

    def result(self) -> TailSample:
        self.run()
        return TailSample(
            self.tokens.tolist(),
            self.noise.tolist(),
            self.support.tolist(),
            torch.from_numpy(self.lse),
            torch.from_numpy(self.picked),
            self.out,
            torch.from_numpy(self.kept),
            torch.from_numpy(self.raw_lse) if self.raw_lse is not None else None,
        )


def gumbel_noise_cpu(ids: torch.Tensor, key: tuple[int, int], lib: NativeLib | None = None) -> torch.Tensor:
    """The kernel's noise (float64) for token ids under one key: what the twins in rng.py must equal."""
    ids = ids.to(torch.int32).contiguous()
    out = torch.empty(ids.shape[0], dtype=torch.float64)
    resolve(lib).fn["gumbel_noise"](ids.data_ptr(), ids.shape[0], key[0], key[1], out.data_ptr())
    return out
