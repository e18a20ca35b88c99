"""The FlashInfer backend's planning (block tables as CSR pages, last-page lengths, causal chunks
with context, sliding windows, the HND view of our strided cache) against the SDPA backend.

FlashInfer's kernels need CUDA; here a stand-in module with the same wrapper API computes
attention from exactly what was planned (pages, lengths, query ranges, window), in torch, on
the CPU. A planning mistake (a wrong page, an off-by-one length or window) changes the output.
tools/gpu_check.py runs the real kernels on a GPU.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from engine.attention.base import SeqSlice
from engine.attention.block_tables import BlockTables
from engine.attention.sdpa import SdpaBackend


class _Wrapper:
    def __init__(self, workspace, kv_layout, use_cuda_graph=False, backend="auto", **buffers):
        assert kv_layout == "HND"
        self.use_cuda_graph = use_cuda_graph

    def plan(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


class FakeDecodeWrapper(_Wrapper):
    def run(self, q, paged, out):
        indptr, indices, last, heads, kv_heads, head_dim, page_size = self.args
        for row in range(q.shape[0]):
            pages = indices[indptr[row] : indptr[row + 1]].long()
            length = (len(pages) - 1) * page_size + int(last[row])
            out[row] = _attend(q[row : row + 1], paged, pages, length, self.kwargs["window_left"])[0]


class FakePrefillWrapper(_Wrapper):
    def run(self, q, paged, out):
        q_indptr, indptr, indices, last, heads, kv_heads, head_dim, page_size = self.args
        assert self.kwargs["causal"]
        for entry in range(len(q_indptr) - 1):
            rows = slice(int(q_indptr[entry]), int(q_indptr[entry + 1]))
            pages = indices[indptr[entry] : indptr[entry + 1]].long()
            length = (len(pages) - 1) * page_size + int(last[entry])
            out[rows] = _attend(q[rows], paged, pages, length, self.kwargs["window_left"])


def _attend(q, paged, pages, length, window_left):
    """Queries at the last len(q) positions of ``length`` keys, causal, FlashInfer's window rule."""
    keys, values = (cache[pages].transpose(0, 1).flatten(1, 2)[:, :length] for cache in paged)  # HND -> [KVH, len, D]
    group = q.shape[1] // keys.shape[0]
    query_pos = torch.arange(length - q.shape[0], length).unsqueeze(1)
    key_pos = torch.arange(length).unsqueeze(0)
    mask = key_pos <= query_pos
    if window_left >= 0:
        mask &= key_pos >= query_pos - window_left
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(), keys.repeat_interleave(group, 0).float(), values.repeat_interleave(group, 0).float(), attn_mask=mask
    )
    return out.transpose(0, 1).to(q.dtype)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = FakeDecodeWrapper
    module.BatchPrefillWithPagedKVCacheWrapper = FakePrefillWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


@pytest.mark.parametrize("window", [None, 5, 21])
def test_planned_pages_lengths_and_windows_attend_what_sdpa_attends(fake_flashinfer, window):
    from engine.attention.flashinfer_paged import FlashInferBackend

    torch.manual_seed(0)
    block_size, kv_heads, heads, head_dim, layers = 4, 2, 6, 8, 3
    # The engine's block-major layout: [blocks, kv_heads, layers, 2, block_size, head_dim].
    cache = torch.randn(40, kv_heads, layers, 2, block_size, head_dim)
    key_view, value_view = (cache[:, :, 1, kind].transpose(1, 2) for kind in (0, 1))  # the layer's [blocks, bs, KVH, D]
    blocks = torch.randperm(40).tolist()
    tables = BlockTables.holding([blocks[0:5], blocks[5:9], blocks[9:12], blocks[12:20]]).array
    slices = [
        SeqSlice(0, 17, 1, decode=True),  # a decode row at a block's edge (18 tokens)
        SeqSlice(1, 12, 3, decode=True),  # speculative: three rows, 13-15 tokens
        SeqSlice(2, 0, 9),  # a chunk from zero
        SeqSlice(3, 20, 11),  # a chunk over cached context, ending mid-block
    ]
    rows = sum(s.num_tokens for s in slices)
    q, k, v = torch.randn(rows, heads, head_dim), torch.randn(rows, kv_heads, head_dim), torch.randn(rows, kv_heads, head_dim)
    backend = FlashInferBackend("cpu", block_size, heads, kv_heads, head_dim, torch.float32, {window})
    got = backend.build(slices, tables).forward(q, k, v, key_view, value_view, window)
    want = SdpaBackend("cpu", block_size).build(slices, tables).forward(q, k, v, key_view.clone(), value_view.clone(), window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
