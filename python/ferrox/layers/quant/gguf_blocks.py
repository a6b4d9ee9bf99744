"""GGUF block formats decoded into one form: w = scale * q + offset, per group of 32 columns.

torch's int4 CPU matmul (int4_weight.py) takes exactly that form with 4-bit q, so every format
whose blocks (or sub-blocks) are 32 wide with one scale and one offset maps onto it without loss:

  Q4_0  w = d * (q - 8)             scale d,        offset -8 d        q 4-bit
  Q4_1  w = d * q + m               scale d,        offset m           q 4-bit
  Q4_K  w = d*sc_j * q - dmin*m_j   scale d*sc_j,   offset -dmin*m_j   q 4-bit, 8 sub-blocks of 32
  Q5_0  w = d * (q - 16)            scale d,        offset -16 d       q 5-bit
  Q5_1  w = d * q + m                                                  q 5-bit
  Q5_K  as Q4_K                                                        q 5-bit
  Q8_0  w = d * q (q signed)        scale d,        offset -128 d      q + 128, 8-bit

Wider q (5-8 bits) runs as two int4 planes (int4_weight.py), still exact. Formats with 16-wide
sub-blocks (Q6_K, Q2_K, Q3_K) or codebooks (IQ*) have no such form: they are dequantized and
requantized to 8-bit groups of 32 (`exact` False): the added error is at most half an 8-bit step
of each group's range, about a quarter of Q6_K's own step (measured in the tests).

Layouts are llama.cpp's (ggml-common.h); the `gguf` package's numpy dequantizer is the reference
the tests compare with.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GROUP = 32  # columns per (scale, offset) pair


@dataclass(frozen=True, slots=True)
class GroupAffine:
    """w[n, k] = scale[n, k // 32] * q[n, k] + offset[n, k // 32]; q unsigned, below 2**bits."""

    q: np.ndarray  # uint8 [rows, cols]
    scale: np.ndarray  # float32 [rows, cols / 32]
    offset: np.ndarray  # float32 [rows, cols / 32]
    bits: int  # 4 or 8 (5-bit formats ride in 8)
    exact: bool  # False when requantized from a format with no such form

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q.shape[0]), int(self.q.shape[1])

    def dequantize(self) -> np.ndarray:
        rows, cols = self.shape
        w = self.q.reshape(rows, cols // GROUP, GROUP).astype(np.float32)
        return (w * self.scale[..., None] + self.offset[..., None]).reshape(rows, cols)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per entry on the last axis -> float32 (little-endian fp16), last axis dropped."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles_split(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32]: low nibbles are elements 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(b: np.ndarray) -> tuple:
    d = _f16(b[..., 0:2])
    return _nibbles_split(b[..., 2:18]), d, -8.0 * d, 4


def _q4_1(b: np.ndarray) -> tuple:
    return _nibbles_split(b[..., 4:20]), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 4


def _fifth_bit(qh: np.ndarray) -> np.ndarray:
    """4 bytes of high bits (a little-endian uint32, bit i for element i) -> [..., 32] of 0/16."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")
    return bits << 4


def _q5_0(b: np.ndarray) -> tuple:
    d = _f16(b[..., 0:2])
    return _nibbles_split(b[..., 6:22]) | _fifth_bit(b[..., 2:6]), d, -16.0 * d, 8


def _q5_1(b: np.ndarray) -> tuple:
    return _nibbles_split(b[..., 8:24]) | _fifth_bit(b[..., 4:8]), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 8


def _q8_0(b: np.ndarray) -> tuple:
    d = _f16(b[..., 0:2])
    q = (np.ascontiguousarray(b[..., 2:34]).view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, d, -128.0 * d, 8


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of 6-bit (scale, min) pairs of Q4_K/Q5_K -> two [..., 8] arrays. Sub-blocks
    0-3 keep their 6 bits in bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 take their low
    4 bits from bytes 8-11 and their top 2 from the spare top bits of bytes 0-7."""
    lo_sc, lo_m, packed = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo_sc & 0x3F, (packed & 0x0F) | ((lo_sc >> 6) << 4)], axis=-1)
    mn = np.concatenate([lo_m & 0x3F, (packed >> 4) | ((lo_m >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 128] bytes -> [..., 8, 32]: each 32-byte chunk c holds sub-block 2c in its low
    nibbles and sub-block 2c+1 in its high nibbles."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return np.concatenate([chunks & 0x0F, chunks >> 4], axis=-2).reshape(*qs.shape[:-1], 8, 32)


def _q4_k(b: np.ndarray) -> tuple:
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales(b[..., 4:16])
    q = _k_nibbles(b[..., 16:144])
    return q, d[..., None] * sc, -dmin[..., None] * mn, 4


def _q5_k(b: np.ndarray) -> tuple:
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales(b[..., 4:16])
    # qh[l] bit j is the fifth bit of element l of sub-block j.
    qh = b[..., 16:48]
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    q = _k_nibbles(b[..., 48:176]) | (high << 4)
    return q, d[..., None] * sc, -dmin[..., None] * mn, 8


# name -> (elements per block, decoder of [rows, blocks, bytes per block])
_DECODERS = {
    "Q4_0": (32, _q4_0), "Q4_1": (32, _q4_1), "Q5_0": (32, _q5_0), "Q5_1": (32, _q5_1),
    "Q8_0": (32, _q8_0), "Q4_K": (256, _q4_k), "Q5_K": (256, _q5_k),
}


def exact_types() -> frozenset[str]:
    """GGUF types that map onto int4 groups without loss."""
    return frozenset(_DECODERS)


def decode_gguf(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> GroupAffine:
    """raw: uint8 [rows, bytes per row] of a GGUF tensor of type `type_name` ("Q4_1", ...) holding
    `shape` = (rows, cols) weights."""
    rows, cols = shape
    if cols % GROUP:
        raise ValueError(f"{type_name} tensor of {cols} columns: not a multiple of {GROUP}")
    entry = _DECODERS.get(type_name)
    if entry is None:
        return requantize_int8(_dequantize(type_name, raw, shape))
    per_block, decoder = entry
    blocks = raw.reshape(rows, cols // per_block, -1)
    q, scale, offset, bits = decoder(blocks)
    return GroupAffine(
        q=np.ascontiguousarray(q.reshape(rows, cols), dtype=np.uint8),
        scale=np.ascontiguousarray(np.asarray(scale, dtype=np.float32).reshape(rows, cols // GROUP)),
        offset=np.ascontiguousarray(np.asarray(offset, dtype=np.float32).reshape(rows, cols // GROUP)),
        bits=bits, exact=True,
    )


def _dequantize(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    w = dequantize(raw, GGMLQuantizationType[type_name])
    return np.asarray(w, dtype=np.float32).reshape(shape)


def requantize_int8(w: np.ndarray) -> GroupAffine:
    """Float weights [rows, cols] -> 8-bit asymmetric groups of 32 (lossy: error <= scale / 2)."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // GROUP, GROUP).astype(np.float32)
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    scale = (hi - lo) / 255.0
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
    q = np.clip(np.rint((g - lo[..., None]) * inv[..., None]), 0, 255).astype(np.uint8)
    return GroupAffine(q=q.reshape(rows, cols), scale=scale, offset=lo, bits=8, exact=False)
