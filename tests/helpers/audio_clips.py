"""Audio for the audio families' tests: samples written as a 16-bit mono wav file (what a client uploads or sends
base64), the bytes PyAV decodes back to the same samples when they are already on the 16-bit grid."""

from __future__ import annotations

import io
import wave

import numpy as np


def wav_bytes(samples: np.ndarray, rate: int = 16_000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.round(np.clip(samples, -1, 1 - 1 / 32768) * 32768).astype(np.int16).tobytes())
    return buf.getvalue()
