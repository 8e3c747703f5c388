"""Counter-based randomness: noise for a token is a pure function of (seed, position, stream, token id).

No generator state exists anywhere: the same key gives the same bits whatever batch the
request is in, however many draws other requests made, and after any preemption. The
hash is a 32-bit integer mixer (xorshift-multiply, constants < 2^31 so products stay
below 2^63 and never overflow int64) applied in two rounds to give 53 uniform bits,
evaluated identically on Python ints and on int64 tensors (any device).
"""

from __future__ import annotations

import math

import torch

MASK32 = 0xFFFFFFFF
_C1 = 0x7FEB352D
_C2 = 0x5BD1E995
_STREAM_SALT = 0x68E31DA4
_SEED_SALT = 0x1B56C4E9
_WORD_SALT = 0x2C1B3C6D
TWO_POW_MINUS_53 = 2.0 ** -53


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
    h = mix32((stream ^ _STREAM_SALT ^ (purpose * 0x3C6EF372)) & MASK32)
    h = mix32(h ^ (position & MASK32))
    h = mix32(h ^ ((position >> 32) & MASK32))
    h = mix32(h ^ (seed & MASK32))
    h = mix32(h ^ ((seed >> 32) & MASK32) ^ _SEED_SALT)
    return h, mix32(h ^ _WORD_SALT)


_TOKEN_HASHES: dict[tuple[int, str], torch.Tensor] = {}


def token_hashes(vocab_size: int, device: torch.device) -> torch.Tensor:
    """mix32(2 * id + 1) for every token id, computed once per (vocab, device)."""
    key = (vocab_size, str(device))
    if key not in _TOKEN_HASHES:
        ids = torch.arange(vocab_size, dtype=torch.int64, device=device)
        _TOKEN_HASHES[key] = mix32(ids * 2 + 1)
    return _TOKEN_HASHES[key]


def uniform_bits(key: tuple[int, int], token_hash: torch.Tensor) -> torch.Tensor:
    """53-bit integers (int64) for the given token hashes under one row key."""
    a = mix32(token_hash ^ key[0])
    b = mix32(a ^ key[1])
    return (a << 21) | (b >> 11)


def gumbel(key: tuple[int, int], token_hash: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise, float64, one value per token hash: -log(-log(u)), u in (0, 1)."""
    u = uniform_bits(key, token_hash).to(torch.float64).add_(0.5).mul_(TWO_POW_MINUS_53)
    return u.log_().neg_().log_().neg_()


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
    return -math.log(-math.log(u))
