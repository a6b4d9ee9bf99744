"""Long audio cut at quiet moments (multimodal/audio_chunks.py, vLLM's speech-to-text chunking), on synthetic
signals at 16 kHz with vLLM's settings (30 s clips, a 1 s search region before each limit, 100 ms windows): a cut
lands at the start of the silent window placed in each search region; the window that ends at the limit is never a
candidate (vLLM's search leaves it out); ties go to the first window; the clips are back to back, each within the
limit, and joined they are the recording; a recording that fits is one clip."""

from __future__ import annotations

import numpy as np
import pytest
from ferrox.multimodal.audio_chunks import quietest_point, split_audio

RATE = 16_000
MAX, OVERLAP, WINDOW = 30 * RATE, RATE, 1600


def _noise(seconds: float, seed: int = 0) -> np.ndarray:
    return (0.3 * np.random.default_rng(seed).standard_normal(int(seconds * RATE))).astype(np.float32)


def _check_clips(samples: np.ndarray, clips: list[np.ndarray]) -> None:
    assert all(0 < len(c) <= MAX for c in clips)
    np.testing.assert_array_equal(np.concatenate(clips), samples)


def test_a_recording_that_fits_is_one_clip():
    samples = _noise(30.0)
    clips = split_audio(samples, MAX, OVERLAP, WINDOW)
    assert len(clips) == 1 and len(clips[0]) == len(samples) and np.shares_memory(clips[0], samples)


def test_cuts_land_on_the_silent_windows():
    samples = _noise(75.0)
    first = MAX - OVERLAP + 5 * WINDOW  # 29.5 s: the sixth window of the first search region
    samples[first:first + WINDOW] = 0.0
    second = first + MAX - OVERLAP + 2 * WINDOW  # the third window of the second clip's search region
    samples[second:second + WINDOW] = 0.0
    clips = split_audio(samples, MAX, OVERLAP, WINDOW)
    assert [len(c) for c in clips] == [first, second - first, len(samples) - second]
    _check_clips(samples, clips)


def test_the_window_ending_at_the_limit_is_not_a_candidate():
    """Energy falling towards the limit: the quietest window is the last one, which vLLM's search leaves out, so
    the cut is at the window before it."""
    samples = np.ones(40 * RATE, dtype=np.float32)
    samples[MAX - OVERLAP:MAX] = np.linspace(1.0, 0.0, OVERLAP, dtype=np.float32)
    assert quietest_point(samples, MAX - OVERLAP, MAX, WINDOW) == MAX - 2 * WINDOW
    clips = split_audio(samples, MAX, OVERLAP, WINDOW)
    assert [len(c) for c in clips] == [MAX - 2 * WINDOW, 40 * RATE - MAX + 2 * WINDOW]


def test_silence_cuts_at_the_first_window_and_clips_stay_within_the_limit():
    samples = np.zeros(95 * RATE, dtype=np.float32)
    clips = split_audio(samples, MAX, OVERLAP, WINDOW)
    assert [len(c) for c in clips[:-1]] == [MAX - OVERLAP] * 3  # (equal energies: the first window)
    _check_clips(samples, clips)
    for seconds in (30.0001, 31.0, 59.9, 61.3, 120.7):
        noisy = _noise(seconds, seed=int(seconds))
        _check_clips(noisy, split_audio(noisy, MAX, OVERLAP, WINDOW))


def test_a_region_shorter_than_a_window_and_bad_settings():
    samples = _noise(1.0)
    assert quietest_point(samples, 100, 100 + WINDOW, WINDOW) == 100 + WINDOW  # (no window starts below its last)
    clips = split_audio(samples, 1000, 500, WINDOW)  # (windows longer than the region: cut at each limit)
    assert [len(c) for c in clips[:-1]] == [1000] * 15
    np.testing.assert_array_equal(np.concatenate(clips), samples)
    for bad in ((0, 1, 1), (10, 0, 1), (10, 11, 1), (10, 5, 0)):
        with pytest.raises(ValueError, match="split_audio"):
            split_audio(samples, *bad)
