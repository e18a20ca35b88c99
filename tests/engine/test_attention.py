"""How decode attention splits a step's sequences into gather groups."""

from __future__ import annotations

import torch

import engine.attention.sdpa
from engine.attention.sdpa import single_groups


def _mask(lengths: list[int], width: int, block_size: int) -> torch.Tensor:
    keys = torch.arange(width * block_size)
    return (keys.unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).view(len(lengths), 1, 1, -1)


def test_groups_take_like_lengths_together_within_the_byte_budget(monkeypatch):
    block_size, block_bytes = 16, 1000
    monkeypatch.setattr(engine.attention.sdpa, "GROUP_GATHER_BYTES", 4 * block_bytes)
    lengths = [16, 64, 17, 3]  # 1, 4, 2 and 1 blocks
    tables = torch.arange(4 * 4).view(4, 4)
    groups = single_groups(tables, _mask(lengths, 4, block_size), block_bytes, "cpu")
    # Shortest first: the two one-block rows share a group (the two-block row would make it
    # 3 x 2 blocks, over the budget of 4), so no row is padded at all here.
    assert [(g.rows.tolist(), g.num_blocks) for g in groups] == [([0, 3], 1), ([2], 2), ([1], 4)]
    assert groups[0].block_ids.tolist() == [0, 12]
    assert groups[1].block_ids.tolist() == [8, 9]
    assert groups[2].block_ids.tolist() == [4, 5, 6, 7]


def test_a_gpu_takes_the_whole_batch_in_one_group():
    tables = torch.arange(6).view(3, 2)
    (group,) = single_groups(tables, _mask([5, 20, 32], 2, 16), 10**9, "cuda")
    assert (group.rows.tolist(), group.num_blocks) == ([0, 1, 2], 2)
