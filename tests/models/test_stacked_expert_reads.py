"""Stacked experts stored [E, in, out] (Llama 4, gpt-oss) are transposed (and gpt-oss's gate / up de-interleaved)
expert by expert as a rank reads them (distributed/sharding.py experts_transposed): a block of experts reads only
those rows of the file, and every read equals the whole tensor transformed then cut."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
from ferrox.distributed.sharding import (
    CheckpointSlice,
    experts_transposed,
    materialize,
    narrow,
    row_block,
    shape_of,
)
from safetensors import safe_open


class _RecordingSlice:
    """A safetensors slice that remembers the row ranges read from it."""

    def __init__(self, file_slice):
        self._slice = file_slice
        self.rows_read: list[tuple[int, int]] = []

    def get_shape(self):
        return self._slice.get_shape()

    def __getitem__(self, index):
        rows = index[0] if index else slice(None)
        self.rows_read.append((rows.start, rows.stop))
        return self._slice[index]


@pytest.fixture(scope="module")
def stacked(tmp_path_factory):
    tensor = torch.randn(6, 4, 10)  # [E, in, out]
    path = tmp_path_factory.mktemp("experts") / "model.safetensors"
    safetensors.torch.save_file({"experts.gate_up_proj": tensor}, str(path))
    with safe_open(str(path), "pt") as f:
        yield tensor, f.get_slice("experts.gate_up_proj")


def test_a_block_of_experts_reads_only_its_rows(stacked):
    tensor, file_slice = stacked
    recording = _RecordingSlice(file_slice)
    view = experts_transposed(CheckpointSlice(recording))
    assert shape_of(view) == (6, 10, 4) and recording.rows_read == []  # (nothing read yet)
    block = row_block(view, 2, 3)
    torch.testing.assert_close(materialize(block), tensor.transpose(1, 2)[2:5], rtol=0, atol=0)
    torch.testing.assert_close(narrow(block, 1, 4, 3), tensor.transpose(1, 2)[2:5, 4:7], rtol=0, atol=0)
    assert recording.rows_read == [(2, 5), (2, 5)]


def test_then_transforms_each_block_and_other_ranks_pass_through(stacked):
    tensor, file_slice = stacked

    def halves(t: torch.Tensor) -> torch.Tensor:  # gpt-oss's gate / up de-interleave
        return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)

    view = experts_transposed(CheckpointSlice(file_slice), halves)
    torch.testing.assert_close(materialize(row_block(view, 4, 2)), halves(tensor.transpose(1, 2))[4:6], rtol=0,
                               atol=0)
    torch.testing.assert_close(materialize(experts_transposed(tensor)), tensor.transpose(1, 2), rtol=0, atol=0)
    flat = torch.zeros(6, 4)
    assert experts_transposed(flat) is flat  # (the loader's shape check names it)
