"""Descriptor merging, compatibility hashing and layout checks (no Ray, no NIXL)."""

from __future__ import annotations

import pytest
import torch

from kvtransfer.descriptors import BlockRun, merge_runs
from kvtransfer.errors import InvalidBlocksError, KVTransferError, LayoutError
from kvtransfer.layout import KVCompat, KVRegion
from kvtransfer.messages import TransferNotif

SMOLLM2 = KVCompat("HuggingFaceTB/SmolLM2-135M", "bfloat16", num_layers=30, num_kv_heads=3, head_dim=64, block_size=16)


@pytest.mark.parametrize(
    "src, dst, runs",
    [
        ([3, 4, 5], [10, 11, 12], [BlockRun(3, 10, 3)]),  # adjacent: one descriptor
        ([5, 4, 3], [12, 11, 10], [BlockRun(3, 10, 3)]),  # listed backwards, still adjacent
        ([3, 4, 5], [12, 11, 10], [BlockRun(3, 12, 1), BlockRun(4, 11, 1), BlockRun(5, 10, 1)]),  # reversed
        ([0, 1, 7, 8, 2], [4, 5, 9, 10, 6], [BlockRun(0, 4, 3), BlockRun(7, 9, 2)]),
        ([9], [0], [BlockRun(9, 0, 1)]),
    ],
)
def test_merge_runs_finds_the_fewest_descriptors(src, dst, runs):
    assert merge_runs(src, dst).as_list() == runs


def test_merge_runs_unmerged_and_invalid_lists():
    assert len(merge_runs([1, 2, 3], [4, 5, 6], merge=False)) == 3
    with pytest.raises(InvalidBlocksError, match="dst_block_ids"):
        merge_runs([1, 2], [4, 4])
    with pytest.raises(InvalidBlocksError, match="2 ids for 3 source blocks"):
        merge_runs([1, 2, 3], [4, 5])


def test_smollm2_block_is_368640_bytes_and_hash_is_stable():
    assert SMOLLM2.bytes_per_block == 368_640
    assert SMOLLM2.compat_hash() == KVCompat(**{f: getattr(SMOLLM2, f) for f in SMOLLM2.__slots__}).compat_hash()
    other = KVCompat("HuggingFaceTB/SmolLM2-135M", "float16", 30, 3, 64, 32)
    assert other.compat_hash() != SMOLLM2.compat_hash()
    assert SMOLLM2.differences(other) == ["dtype: 'bfloat16' != 'float16'", "block_size: 16 != 32"]


def test_kv_tensor_must_match_the_layout():
    compat = KVCompat("m", "bfloat16", 2, 2, 8, 4)
    good = torch.zeros((5, *compat.block_shape()), dtype=torch.bfloat16)
    compat.check_tensor(good)
    region = KVRegion.from_tensor(good)
    assert region.num_blocks == 5 and region.bytes_per_block == compat.bytes_per_block
    assert region.block_addr(2) == good[2].data_ptr()
    with pytest.raises(LayoutError, match="dtype float16"):
        compat.check_tensor(good.to(torch.float16))
    with pytest.raises(LayoutError, match="shape"):
        compat.check_tensor(torch.zeros((5, 2, 2, 4, 8, 2), dtype=torch.bfloat16))
    with pytest.raises(LayoutError, match="contiguous"):
        compat.check_tensor(torch.zeros((2, 5, *compat.block_shape()[1:]), dtype=torch.bfloat16).transpose(0, 1))
    with pytest.raises(LayoutError, match="dtype"):
        KVCompat("m", "complex64", 2, 2, 8, 4)


def test_a_quantized_cache_is_raw_bytes_with_its_scales_and_never_matches_an_unquantized_one():
    int8 = KVCompat("HuggingFaceTB/SmolLM2-135M", "int8", 30, 3, 64, 16, block_scales=True)
    # One byte per element plus a float32 scale per layer, key/value and KV head.
    assert int8.bytes_per_block == 184_320 + 30 * 2 * 3 * 4 <= 0.55 * SMOLLM2.bytes_per_block
    assert int8.differences(SMOLLM2) == ["dtype: 'int8' != 'bfloat16'", "block_scales: True != False"]
    int8.check_tensor(torch.zeros((4, int8.bytes_per_block), dtype=torch.uint8))
    assert KVRegion.from_tensor(torch.zeros((4, int8.bytes_per_block), dtype=torch.uint8)).bytes_per_block == int8.bytes_per_block
    with pytest.raises(LayoutError, match="block scales"):
        int8.check_tensor(torch.zeros((4, 184_320), dtype=torch.uint8))


def test_notification_round_trip_and_foreign_messages():
    notif = TransferNotif("req-é", 7, 3, 12, [(4, 3), (20, 1)])
    assert TransferNotif.decode(notif.encode()) == notif
    with pytest.raises(KVTransferError):
        TransferNotif.decode(b"hello")
    with pytest.raises(KVTransferError):
        TransferNotif.decode(b"pdkv1:{not json")


def test_notification_payload_round_trips_and_is_optional():
    from kvtransfer.messages import TransferNotif

    with_payload = TransferNotif("r1", 7, 3, 4, [(0, 2), (5, 2)], payload='{"id":42}')
    assert TransferNotif.decode(with_payload.encode()) == with_payload
    plain = TransferNotif("r1", 7, 0, 1, [(0, 1)])
    assert b'"p"' not in plain.encode() and TransferNotif.decode(plain.encode()).payload == ""
