"""Counter-based randomness: noise for a token is a pure function of (seed, position, stream, token id).

No generator state exists anywhere: the same key gives the same bits whatever batch the
request is in, however many draws other requests made, and after any preemption. The
hash is a 32-bit integer mixer (xorshift-multiply, constants < 2^31 so products stay
below 2^63 and never overflow int64) applied in two rounds to give 53 uniform bits,
evaluated identically on Python ints and on int64 tensors (any device).

Gumbel noise -log(-log(u)) takes its logarithm from `log_positive`, our own (fdlibm's reduction and
polynomial) in +, -, *, / of doubles only, each step one correctly rounded IEEE operation: the
native kernel (toolkit/native/csrc/gumbel.c), the torch twin and the Python-float twin here give the same
bits on every CPU. (torch.log does not: its vectorised body and its scalar tail are two libraries,
so a token's noise could change in the last bit with its place in the row. Traces of schema 3 drew
noise that way; see toolkit/trace/schema.py.)
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import torch

from toolkit.devices import to_device

MASK32 = 0xFFFFFFFF
_C1 = 0x7FEB352D
_C2 = 0x5BD1E995
_STREAM_SALT = 0x68E31DA4
_SEED_SALT = 0x1B56C4E9
_WORD_SALT = 0x2C1B3C6D
TWO_POW_MINUS_53 = 2.0**-53


def mix32(x):
    """A bijective 32-bit mixer on an int or an int64 tensor holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * _C1) & MASK32
    x = x ^ (x >> 15)
    x = (x * _C2) & MASK32
    return x ^ (x >> 16)


# What a draw is for: the same (seed, position, stream) gives independent noise per purpose.
SAMPLE, DRAFT, ACCEPT, RESIDUAL = 0, 1, 2, 3


def row_key(seed: int, position: int, stream: int, purpose: int = SAMPLE) -> tuple[int, int]:
    """Two 32-bit words that key every token's noise at one (seed, position, stream, purpose).

    `SAMPLE` noise picks a token (plain sampling, the target in coupled speculation, and the
    draft in coupled mode); `DRAFT`, `ACCEPT` and `RESIDUAL` are the draft's own samples, the
    acceptance uniforms and the residual samples of rejection-sampling speculation.
    """
    return _key_words(
        seed & MASK32,
        (seed >> 32) & MASK32,
        position & MASK32,
        (position >> 32) & MASK32,
        stream & MASK32,
        purpose & MASK32,
    )


def row_keys(rows: Sequence[tuple[int, int, int, int]]) -> list[tuple[int, int]]:
    """row_key of many (seed, position, stream, purpose) rows at once: the same words, mixed as numpy
    arrays (the per-row Python calls took ~2 us a row)."""
    if len(rows) < 4:
        return [row_key(*row) for row in rows]
    words = np.array(
        [
            (
                seed & MASK32,
                (seed >> 32) & MASK32,
                position & MASK32,
                (position >> 32) & MASK32,
                stream & MASK32,
                purpose & MASK32,
            )
            for seed, position, stream, purpose in rows
        ],
        dtype=np.uint64,
    )
    k0, k1 = _key_words(*words.T)
    return list(zip(k0.tolist(), k1.tolist()))


def _key_words(seed_lo, seed_hi, pos_lo, pos_hi, stream, purpose):
    """The key's two words from 32-bit words (ints, or uint64 arrays of them)."""
    h = mix32((stream ^ _STREAM_SALT ^ (purpose * 0x3C6EF372)) & MASK32)
    h = mix32(h ^ pos_lo)
    h = mix32(h ^ pos_hi)
    h = mix32(h ^ seed_lo)
    h = mix32(h ^ seed_hi ^ _SEED_SALT)
    return h, mix32(h ^ _WORD_SALT)


_TOKEN_HASHES: dict[tuple[int, str], torch.Tensor] = {}


def token_hashes(vocab_size: int, device: torch.device) -> torch.Tensor:
    """mix32(2 * id + 1) for every token id, computed once per (vocab, device)."""
    key = (vocab_size, str(device))
    if key not in _TOKEN_HASHES:
        ids = torch.arange(vocab_size, dtype=torch.int64, device=device)
        _TOKEN_HASHES[key] = mix32(ids * 2 + 1)
    return _TOKEN_HASHES[key]


# fdlibm's log: x = 2^k m, m in [sqrt(1/2), sqrt(2)), log m = 2 atanh(f / (2 + f)), f = m - 1
_LG = (
    6.666666666666735130e-01,
    3.999999999940941908e-01,
    2.857142874366239149e-01,
    2.222219843214978396e-01,
    1.818357216161805012e-01,
    1.531383769920937332e-01,
    1.479819860511658591e-01,
)
_LN2_HI, _LN2_LO = 6.93147180369123816490e-01, 1.90821492927058770002e-10
_MANTISSA, _SQRT2_MANTISSA, _ONE, _HALF_STEP = 0x000FFFFFFFFFFFFF, 0x6A09E667F3BCD, 0x3FF0000000000000, 1 << 52


def _log_polynomial(k, f):
    """log(2^k (1 + f)) from the reduced argument; the same operations, in the same order, as
    toolkit/native/csrc/gumbel.c's dlog, on floats or float64 tensors."""
    s = f / (f + 2.0)
    z = s * s
    w = z * z
    t1 = w * (w * (w * _LG[5] + _LG[3]) + _LG[1])
    t2 = z * (w * (w * (w * _LG[6] + _LG[4]) + _LG[2]) + _LG[0])
    r = t2 + t1
    hfsq = f * 0.5 * f
    return k * _LN2_HI - ((hfsq - (s * (hfsq + r) + k * _LN2_LO)) - f)


def log_positive(x: torch.Tensor) -> torch.Tensor:
    """log of positive normal float64 values, bit-identical to the native kernel's."""
    bits = x.view(torch.int64)
    mantissa = bits & _MANTISSA
    big = (mantissa > _SQRT2_MANTISSA).to(torch.int64)  # mantissa above sqrt(2): halve it
    k = ((bits >> 52) - 1023 + big).to(torch.float64)
    m = (mantissa | (_ONE - big * _HALF_STEP)).view(torch.float64)
    return _log_polynomial(k, m - 1.0)


def log_positive_scalar(x: float) -> float:
    """The same logarithm on one Python float."""
    (bits,) = struct.unpack("<q", struct.pack("<d", x))
    mantissa = bits & _MANTISSA
    big = 1 if mantissa > _SQRT2_MANTISSA else 0
    (m,) = struct.unpack("<d", struct.pack("<q", mantissa | (_ONE - big * _HALF_STEP)))
    return _log_polynomial(float((bits >> 52) - 1023 + big), m - 1.0)


def uniform_bits(key: tuple[int, int], token_hash: torch.Tensor) -> torch.Tensor:
    """53-bit integers (int64) for the given token hashes under one row key."""
    a = mix32(token_hash ^ key[0])
    b = mix32(a ^ key[1])
    return (a << 21) | (b >> 11)


def gumbel(key: tuple[int, int], token_hash: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise, float64, one value per token hash: -log(-log(u)), u in (0, 1)."""
    u = uniform_bits(key, token_hash).to(torch.float64).add_(0.5).mul_(TWO_POW_MINUS_53)
    return -log_positive(-log_positive(u))


def key_words(keys: Sequence[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """(R, 2) int64: the rows' keys, ready to broadcast against token hashes (one copy to the device)."""
    return to_device(torch.tensor(list(keys), dtype=torch.int64).reshape(-1, 2), device)


def gumbel_rows(keys_R2: torch.Tensor, token_hash_RV: torch.Tensor) -> torch.Tensor:
    """Gumbel noise of many rows at once, float64: row r under key keys_R2[r], `token_hash_RV` the hashes of
    its tokens (an (R, V) block, or one (1, V) or (V,) row of hashes shared by every row). Each element takes
    the same integer mixing and correctly rounded double operations as `gumbel`, so row r holds exactly
    gumbel(keys_R2[r], ...) on any device, in a fixed number of tensor operations whatever R is."""
    k0, k1 = keys_R2[:, :1], keys_R2[:, 1:]
    a = mix32(token_hash_RV ^ k0)
    b = mix32(a ^ k1)
    u = ((a << 21) | (b >> 11)).to(torch.float64).add_(0.5).mul_(TWO_POW_MINUS_53)
    return -log_positive(-log_positive(u))


def uniform_scalar(key: tuple[int, int], token_id: int = 0) -> float:
    """One uniform in (0, 1) under a key (the acceptance test of rejection sampling)."""
    a = mix32(mix32(token_id * 2 + 1) ^ key[0])
    b = mix32(a ^ key[1])
    return (((a << 21) | (b >> 11)) + 0.5) * TWO_POW_MINUS_53


def gumbel_scalar(key: tuple[int, int], token_id: int) -> float:
    """The same noise for one token, in Python floats (for checks and traces)."""
    a = mix32(mix32(token_id * 2 + 1) ^ key[0])
    b = mix32(a ^ key[1])
    u = (((a << 21) | (b >> 11)) + 0.5) * TWO_POW_MINUS_53
    return -log_positive_scalar(-log_positive_scalar(u))
