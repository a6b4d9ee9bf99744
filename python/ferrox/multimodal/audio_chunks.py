"""Long audio cut into clips a speech model takes whole, at quiet moments (vLLM's speech-to-text chunking).

A model takes at most `max_samples` of audio in one clip (30 s for Gemma 4 and Qwen2-Audio). A longer recording is
cut into consecutive clips: each cut is searched for in the last `overlap` samples before the limit (vLLM's
overlap_chunk_second, 1 s), where the audio is split at the start of its quietest window (`window` samples, vLLM's
min_energy_split_window_size, 1,600 = 100 ms at 16 kHz: the lowest root-mean-square energy, the first of equals),
so a cut falls in a pause rather than through a word. The clips lie back to back: nothing is dropped or repeated,
and joined they are the recording. Each is transcribed on its own and the texts are joined in order.

As vLLM's, the candidate windows start every `window` samples from the search region's start and end before its
last window (the window that would end exactly at the limit is not one of them), so every clip but the last is
shorter than max_samples and the last one is longer than one window. numpy only.
"""

from __future__ import annotations

import numpy as np

# vLLM's SpeechToTextConfig defaults.
OVERLAP_SECONDS = 1
ENERGY_WINDOW_SAMPLES = 1600


def quietest_point(samples: np.ndarray, start: int, end: int, window: int) -> int:
    """The start of the quietest `window`-sample window in samples[start:end] (windows every `window` samples from
    `start`, the last full one left out as vLLM's search leaves it); `end` when the region holds no such window."""
    region = np.asarray(samples[start:end], dtype=np.float64)
    count = (len(region) - 1) // window  # windows at 0, w, ... whose start is below len - w
    if count <= 0:
        return end
    energy = np.sqrt(np.mean(region[:count * window].reshape(count, window) ** 2, axis=1))
    return start + int(np.argmin(energy)) * window  # (argmin: the first of equal minima)


def split_audio(samples: np.ndarray, max_samples: int, overlap: int, window: int = ENERGY_WINDOW_SAMPLES
                ) -> list[np.ndarray]:
    """`samples` as consecutive clips of at most `max_samples` each (one clip, the array itself, when it fits);
    each cut at quietest_point within the last `overlap` samples before the limit."""
    if max_samples < 1 or window < 1 or not 0 < overlap <= max_samples:
        raise ValueError(f"split_audio: needs max_samples >= 1, 0 < overlap <= max_samples and window >= 1 (got "
                         f"{max_samples}, {overlap}, {window})")
    total = len(samples)
    clips: list[np.ndarray] = []
    at = 0
    while total - at > max_samples:
        limit = at + max_samples
        cut = quietest_point(samples, limit - overlap, limit, window)
        if cut <= at:  # (a region no longer than one window past `at`: cut at the limit)
            cut = limit
        clips.append(samples[at:cut])
        at = cut
    clips.append(samples[at:])
    return clips
