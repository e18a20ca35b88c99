"""The Triton kernels for CUDA, run here under Triton's interpreter: the one-launch KV write puts
keys and values where the indexed stores do; for a quantized cache it follows the torch rules
(scales that only grow, earlier rows requantized where they grew); decode attention over int8
blocks equals the portable backend's dequantize + SDPA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import EngineConfig
from engine.attention.base import SeqSlice
from engine.attention.block_tables import BlockTables
from engine.attention.kv_write import write_quantized_torch
from engine.attention.sdpa import SdpaBackend
from engine.config import ModelConfig
from engine.default_model_path import DEFAULT_MODEL_PATH
from engine.kv_cache import KVCache

# Triton's interpreter cannot load or store fp8 elements: fp8 runs on a GPU (tools/gpu_check.py,
# section quantized), which checks both kinds against the same references.
KINDS = ["int8"]
BLOCK_SIZE = 8


# Triton decides between compiling and interpreting when it is imported (its own library's
# functions too): the kernel tests run in a process of their own that imports it interpreted.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
under_interpreter = pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreted process (test_kernels_under_the_interpreter)")


@pytest.mark.skipif(INTERPRETED, reason="this is that process")
def test_kernels_under_the_interpreter():
    # One process ("-n 0"): two xdist workers for one file cost a second start (9 s of CPU).
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", str(Path(__file__))],
        env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "18 passed" in result.stdout, result.stdout[-2000:]


@pytest.fixture(scope="module")
def triton_quantized():
    import engine.attention.triton_quantized as module

    return module


@pytest.fixture(scope="module")
def triton_kv_write():
    import engine.attention.triton_kv_write as module

    return module


def _cache(kind: str, num_blocks: int = 12) -> KVCache:
    config = EngineConfig(kv_cache_dtype=kind, num_kv_blocks=num_blocks, block_size=BLOCK_SIZE)
    return KVCache(ModelConfig.from_model_dir(DEFAULT_MODEL_PATH), config, torch.float32)


def _runs(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    change = (torch.nonzero(blocks[1:] != blocks[:-1]).flatten() + 1).tolist()
    return torch.tensor([0, *change]), torch.tensor([*change, len(blocks)])


def _writes(heads: int, dim: int, seed: int = 0):
    """Writes as an engine makes them: prompts in chunks across blocks, then a token per step
    (larger ones later, so scales grow and earlier rows are requantized), and a block taken
    again from offset 0 (a fresh start)."""
    g = torch.Generator().manual_seed(seed)
    for step, (positions, blocks) in enumerate([
        ([0, 1, 2, 3, 4], [1, 1, 1, 1, 1]),
        ([5, 6, 7, 8, 9, 0, 1], [1, 1, 1, 2, 2, 4, 4]),
        ([10, 2], [2, 4]),
        ([11, 3], [2, 4]),
        ([0, 1], [1, 1]),
    ]):
        x = torch.randn(len(positions), heads, dim, generator=g) * (1 + step)
        yield x, torch.tensor(blocks), torch.tensor([p % BLOCK_SIZE for p in positions])


@under_interpreter
@pytest.mark.parametrize("kind", KINDS)
def test_the_quantized_write_follows_the_torch_rules(triton_kv_write, kind):
    ours, reference = _cache(kind), _cache(kind)
    heads, dim = ours.key_views[0].shape[2:]
    for (k, blocks, offsets), (v, _, _) in zip(_writes(heads, dim), _writes(heads, dim, seed=1)):
        triton_kv_write.write_quantized_pair(
            k, v, ours.key_views[1], ours.value_views[1], ours.key_scales[1], ours.value_scales[1], blocks, offsets, *_runs(blocks)
        )
        write_quantized_torch(k, reference.key_views[1], reference.key_scales[1], blocks, offsets)
        write_quantized_torch(v, reference.value_views[1], reference.value_scales[1], blocks, offsets)
    assert torch.equal(ours.key_scales[1], reference.key_scales[1]) and torch.equal(ours.value_scales[1], reference.value_scales[1])
    assert torch.equal(ours.tensor, reference.tensor), "every element, scale and untouched byte alike"


@under_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("views", ["engine", "odd"])
def test_the_plain_write_puts_keys_and_values_where_the_indexed_stores_do(triton_kv_write, dtype, views):
    """Into every layer's views of one cache: the engine's own (``KVCache``), and views with
    head counts and sizes not powers of two; keys as their own tensor and values as a slice of
    a wider one (q|k|v), as the model hands them over."""
    if views == "engine":
        cache = KVCache(ModelConfig.from_model_dir(DEFAULT_MODEL_PATH), EngineConfig(num_kv_blocks=6, block_size=BLOCK_SIZE), dtype)
        ours, key_views, value_views = cache.tensor, cache.key_views, cache.value_views
    else:
        ours = torch.zeros(6, 3, 2, BLOCK_SIZE, 3, 80, dtype=dtype)
        key_views, value_views = [ours[:, i, 0] for i in range(3)], [ours[:, i, 1] for i in range(3)]
    reference = ours.clone()
    heads, dim = key_views[0].shape[2:]
    g = torch.Generator().manual_seed(5)
    for layer in range(len(key_views)):
        for _, blocks, offsets in _writes(heads, dim, seed=layer):
            rows = len(blocks)
            k = torch.randn(rows, heads, dim, generator=g).to(dtype)
            qkv = torch.randn(rows, 4 * heads * dim, generator=g).to(dtype)
            v = qkv[:, 3 * heads * dim :].view(rows, heads, dim)
            triton_kv_write.write_pair(k, v, key_views[layer], value_views[layer], blocks, offsets)
            # The indexed stores, on the same views of the reference's storage.
            reference_keys = reference.as_strided(key_views[layer].shape, key_views[layer].stride(), key_views[layer].storage_offset())
            reference_values = reference.as_strided(value_views[layer].shape, value_views[layer].stride(), value_views[layer].storage_offset())
            reference_keys[blocks, offsets] = k
            reference_values[blocks, offsets] = v
    assert torch.equal(ours, reference)


@under_interpreter
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("window", [None, 11])
def test_decode_attention_over_quantized_blocks_is_the_portable_backends(triton_quantized, kind, window):
    """Decode rows (one at a block's edge, three speculative ones) and a prompt chunk with
    context, GQA, written and attended by each backend in turn on its own copy of the cache."""
    caches = {name: _cache(kind) for name in ("triton", "sdpa")}
    heads = caches["sdpa"].key_views[0].shape[2]
    num_q_heads = 3 * heads
    dim = caches["sdpa"].key_views[0].shape[3]
    g = torch.Generator().manual_seed(3)
    for cache in caches.values():  # the same earlier context in both
        for layer_view, scales in ((cache.key_views[0], cache.key_scales[0]), (cache.value_views[0], cache.value_scales[0])):
            for block in range(cache.num_blocks):
                x = torch.randn(BLOCK_SIZE, heads, dim, generator=torch.Generator().manual_seed(block)) * (1 + block % 3)
                write_quantized_torch(x, layer_view, scales, torch.full((BLOCK_SIZE,), block), torch.arange(BLOCK_SIZE))
    tables = BlockTables.holding([[3, 5, 1], [7, 0, 9, 2], [4, 11, 6]]).array
    slices = [SeqSlice(0, 23, 1, decode=True), SeqSlice(1, 26, 3, decode=True), SeqSlice(2, 9, 7)]
    rows = sum(s.num_tokens for s in slices)
    q, k, v = torch.randn(rows, num_q_heads, dim, generator=g), torch.randn(rows, heads, dim, generator=g), torch.randn(rows, heads, dim, generator=g)
    got = {}
    for name, backend in (("triton", triton_quantized.TritonQuantizedBackend("cpu", BLOCK_SIZE)), ("sdpa", SdpaBackend("cpu", BLOCK_SIZE))):
        cache = caches[name]
        meta = backend.build(slices, tables)
        got[name] = meta.forward(q, k, v, cache.key_views[0], cache.value_views[0], window, cache.key_scales[0], cache.value_scales[0])
    assert torch.equal(caches["triton"].tensor, caches["sdpa"].tensor), "the same writes"
    torch.testing.assert_close(got["triton"], got["sdpa"], rtol=1e-4, atol=1e-5)


@under_interpreter
def test_decode_attention_split_over_a_rows_context_is_the_one_pass_kernels(triton_quantized, monkeypatch):
    """Rows attended split by split and merged (flash-decoding) give the one-pass kernel's output:
    splits of one block and of several, a row of one block (its one split: exactly the one-pass
    output), a row ending at a block's edge, a sliding window starting inside a split, and rows
    of more blocks than the splits allowed (longer splits); split kernels that fail to build
    leave the one-pass kernel."""
    cache = _cache("int8", num_blocks=12)
    heads, dim = cache.key_views[0].shape[2:]
    for view, scales in ((cache.key_views[0], cache.key_scales[0]), (cache.value_views[0], cache.value_scales[0])):
        for block in range(cache.num_blocks):
            x = torch.randn(BLOCK_SIZE, heads, dim, generator=torch.Generator().manual_seed(block)) * (1 + block % 3)
            write_quantized_torch(x, view, scales, torch.full((BLOCK_SIZE,), block), torch.arange(BLOCK_SIZE))
    g = torch.Generator().manual_seed(9)
    lens = torch.tensor([5, 2 * BLOCK_SIZE, 7 * BLOCK_SIZE + 3, 12 * BLOCK_SIZE])
    tables = torch.stack([torch.randperm(12, generator=g) for _ in lens])
    q = torch.randn(len(lens), 3 * heads, dim, generator=g)

    def attend(window, split_tokens):
        return triton_quantized.attend_decode(q, cache.key_views[0], cache.value_views[0], cache.key_scales[0], cache.value_scales[0],
                                              tables, lens, window, split_tokens=split_tokens)

    one_pass = {window: attend(window, 10**9) for window in (None, 19)}
    for window in one_pass:  # splits of one block
        split = attend(window, BLOCK_SIZE)
        torch.testing.assert_close(split, one_pass[window], rtol=1e-5, atol=1e-6)
        assert torch.equal(split[0], one_pass[window][0]), "a row of one split"
    monkeypatch.setattr(triton_quantized, "MAX_SPLITS", 3)  # 12 blocks in 3 splits of 4, 7 in 3 of 3
    torch.testing.assert_close(attend(None, BLOCK_SIZE), one_pass[None], rtol=1e-5, atol=1e-6)

    class Unbuildable:  # split kernels that do not build here: the one pass from then on
        def __getitem__(self, grid):
            raise RuntimeError("no kernel here")

    monkeypatch.setattr(triton_quantized, "_decode_split_kernel", Unbuildable())
    monkeypatch.setattr(triton_quantized, "_splits_build", True)
    assert torch.equal(attend(None, BLOCK_SIZE), one_pass[None]) and triton_quantized._splits_build is False


@under_interpreter
@pytest.mark.parametrize("split_tokens", [None, BLOCK_SIZE], ids=["one pass", "split"])
def test_decode_over_a_cuda_graphs_fixed_buffers_is_the_eager_steps(triton_quantized, monkeypatch, split_tokens):
    """What a CUDA graph of a quantized cache replays (engine.cuda_graphs in tables mode): decode
    rows padded up to a bucket with rows on the scratch block, block tables padded to the
    buffer's width, every row its own write run (TritonQuantizedBackend.graph_metadata): the real
    rows' attention and KV writes are the eager step's, element for element; split over a row's
    blocks too (the graph's wider tables give it more splits, each row the same ones)."""
    if split_tokens is not None:
        monkeypatch.setattr(triton_quantized, "SPLIT_TOKENS", split_tokens)
    config = EngineConfig(kv_cache_dtype="int8", num_kv_blocks=12, block_size=BLOCK_SIZE)
    caches = {name: KVCache(ModelConfig.from_model_dir(DEFAULT_MODEL_PATH), config, torch.float32, scratch_block=True) for name in ("eager", "graph")}
    heads, dim = caches["eager"].key_views[0].shape[2:]
    for cache in caches.values():  # the same earlier context in both
        for view, scales in ((cache.key_views[0], cache.key_scales[0]), (cache.value_views[0], cache.value_scales[0])):
            for block in range(cache.num_blocks):
                x = torch.randn(BLOCK_SIZE, heads, dim, generator=torch.Generator().manual_seed(block)) * (1 + block % 3)
                write_quantized_torch(x, view, scales, torch.full((BLOCK_SIZE,), block), torch.arange(BLOCK_SIZE))
    table_rows = [[3, 5, 1], [7, 0, 9, 2], [4, 11]]
    slices = [SeqSlice(0, 23, 1, decode=True), SeqSlice(1, 26, 1, decode=True), SeqSlice(2, 8, 1, decode=True)]
    tables = BlockTables.holding(table_rows).array
    backend = triton_quantized.TritonQuantizedBackend("cpu", BLOCK_SIZE)
    g = torch.Generator().manual_seed(4)
    bucket, width, rows = 5, 6, len(slices)
    q, k, v = torch.randn(bucket, 3 * heads, dim, generator=g), torch.randn(bucket, heads, dim, generator=g), torch.randn(bucket, heads, dim, generator=g)
    eager = backend.build(slices, tables)
    want = eager.forward(q[:rows], k[:rows], v[:rows], caches["eager"].key_views[0], caches["eager"].value_views[0], None,
                         caches["eager"].key_scales[0], caches["eager"].value_scales[0])

    scratch = caches["graph"].scratch_block
    padded_tables = torch.full((bucket, width), scratch, dtype=torch.long)
    lens = torch.ones(bucket, dtype=torch.long)
    slot_blocks = torch.full((bucket,), scratch, dtype=torch.long)
    slot_offsets = torch.zeros(bucket, dtype=torch.long)
    for row, (piece, table) in enumerate(zip(slices, table_rows)):
        padded_tables[row, : len(table)] = torch.tensor(table)
        lens[row] = piece.context_len + 1
        slot_blocks[row], slot_offsets[row] = table[piece.context_len // BLOCK_SIZE], piece.context_len % BLOCK_SIZE
    replayed = backend.graph_metadata(slot_blocks, slot_offsets, padded_tables, lens)
    got = replayed.forward(q, k, v, caches["graph"].key_views[0], caches["graph"].value_views[0], None,
                           caches["graph"].key_scales[0], caches["graph"].value_scales[0])
    assert torch.equal(got[:rows], want)
    for name in ("key_views", "value_views", "key_scales", "value_scales"):
        assert torch.equal(getattr(caches["graph"], name)[0][:scratch], getattr(caches["eager"], name)[0][:scratch]), name


@under_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(6, 2, 64), (3, 1, 80)])
def test_the_rotation_fused_into_the_write_is_the_float32_rotation_then_the_write(triton_kv_write, dtype, shape):
    """q and k, strided views of a q|k|v row as a layer hands them over, rotated in place as
    FlashInfer rotates (float32 from the float32 cos|sin table, rounded once), the rotated keys
    and the values in the cache at their slots, nothing else touched; head counts and sizes
    that are not powers of two too."""
    from engine.config import RopeConfig
    from engine.rope import RotaryEmbedding

    heads, kv_heads, dim = shape
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), dim, 64, dtype, "cpu", fused_cache=True)
    g = torch.Generator().manual_seed(7)
    cache = torch.randn(6, 2, 2, BLOCK_SIZE, kv_heads, dim, generator=g).to(dtype)  # [blocks, layers, k|v, ...]
    reference = cache.clone()
    for _, blocks, offsets in _writes(kv_heads, dim):
        rows = len(blocks)
        positions = torch.randint(0, 64, (rows,), generator=g)
        qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
        q, k, v = (x.view(rows, -1, dim) for x in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
        cos, sin = (half.unsqueeze(1) for half in rotary.cos_sin_cache[positions].chunk(2, dim=-1))
        want_q, want_k = (x.to(dtype) for x in RotaryEmbedding.rotate(q.float(), k.float(), cos, sin))
        want_v = v.clone()
        triton_kv_write.rotate_and_write_pair(q, k, v, cache[:, 1, 0], cache[:, 1, 1], blocks, offsets, positions, rotary.cos_sin_cache)
        assert_rounded_alike(q, want_q)
        assert_rounded_alike(k, want_k)
        assert torch.equal(v, want_v)
        assert_rounded_alike(cache[blocks, 1, 0, offsets], want_k)
        reference[blocks, 1, 0, offsets] = cache[blocks, 1, 0, offsets]
        reference[blocks, 1, 1, offsets] = want_v
    assert torch.equal(cache, reference), "the slots written, every other element as it was"


def assert_rounded_alike(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal, but for bfloat16 within one unit in the last place: Triton's interpreter turns
    float32 into bfloat16 by cutting bits (a GPU rounds to nearest, as torch does)."""
    if got.dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0)
    else:
        assert torch.equal(got, want)


@under_interpreter
@pytest.mark.parametrize("overlapped", [False, True], ids=["one step at a time", "overlapped"])
def test_the_penalties_in_one_launch_are_the_torch_ops_step_after_step(overlapped):
    """The fused penalties (engine.triton_penalties) give, step after step, the logits the torch
    ops over whole rows give, element for element: the three penalties alone and together, a
    penalty so strong it overflows (held at the float32 limit), a row without any (untouched),
    requests leaving and joining (a freed slab row taken again); overlapped, each sequence's token
    from the step in flight counted from the device and written into the history as the torch
    path's scatters write it."""
    import gc
    import random

    from engine import SamplingParams
    from engine.model_runner import PendingSamples
    from engine.penalties import PenaltyHistory
    from engine.sequence import Sequence

    vocab = 5000  # over two of the kernel's runs of columns
    rng = random.Random(0)

    def sequence(name: str, prompt_len: int, **penalties) -> Sequence:
        params = SamplingParams(temperature=0.7, max_tokens=100, **penalties)
        return Sequence(name, [rng.randrange(vocab) for _ in range(prompt_len)], prompt_len, params)

    fused, torch_ops = PenaltyHistory(whole_rows=True, fused=True), PenaltyHistory(whole_rows=True, fused=False)
    running = [
        sequence("rep", 40, repetition_penalty=1.3),
        sequence("freq", 25, frequency_penalty=0.5),
        sequence("none", 12),
        sequence("all", 60, repetition_penalty=0.7, frequency_penalty=0.25, presence_penalty=0.4),
        sequence("overflow", 30, repetition_penalty=1e-38, presence_penalty=-0.8),
    ]
    for step in range(8):
        if step == 5:  # one ends (its row is given back) and two arrive, one taking that row
            running = [s for s in running if s.req_id != "freq"]
            gc.collect()
            running += [sequence("late", 33, repetition_penalty=2.0, presence_penalty=0.3), sequence("later", 5, frequency_penalty=0.9)]
        if step == 6:  # every row penalised (the kernel writes every element; nothing copied first)
            running = [s for s in running if s.req_id != "none"]
        logits = torch.randn(len(running), vocab, generator=torch.Generator().manual_seed(step)) * 3
        logits[:, :7] = 0.0  # neither side of the repetition penalty's sign test
        sampled = [rng.choice(s.token_ids) if rng.random() < 0.5 else rng.randrange(vocab) for s in running]
        pending = None
        if overlapped and step % 2 == 1:
            pending = PendingSamples(torch.tensor(sampled), {id(s): r for r, s in enumerate(running)})
            for seq in running:
                seq.num_pending_tokens = 1
        got, want = fused.apply(logits, running, pending), torch_ops.apply(logits, running, pending)
        assert torch.equal(got, want), f"step {step}"
        plain = [i for i, s in enumerate(running) if s.req_id == "none"]
        assert torch.equal(got[plain], logits[plain]) and not torch.equal(got, logits)
        assert got.abs().max() <= torch.finfo(torch.float32).max
        assert torch.equal(fused.seen, torch_ops.seen) and torch.equal(fused.output_counts, torch_ops.output_counts), f"step {step}: the histories"
        for seq, token in zip(running, sampled):  # the host reads the step's tokens
            seq.num_pending_tokens = 0
            seq.token_ids.append(token)


@under_interpreter
def test_a_top_k_rows_filters_and_draw_in_one_launch_are_the_torch_ops():
    """The top-k rows' filters and inverse-CDF draw in one launch (engine.triton_sampling) pick,
    for the same candidates and uniforms, the token the torch ops pick: Qwen's defaults, top-k
    with top-p, with min-p, top-k alone, top-k 1, a temperature below the floor, tied logits, a
    k below the batch's widest (the row's own k applies), and uniforms at the very ends."""
    from engine import SamplingParams
    from engine.sampler import _inverse_cdf_no_sync, _top_k_candidates
    from engine.triton_sampling import draw_among_top_k

    kinds = [
        SamplingParams(temperature=0.7, top_k=20, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=50, top_p=0.95),
        SamplingParams(temperature=1.3, top_k=9, min_p=0.3),
        SamplingParams(temperature=0.9, top_k=37),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1e-30, top_k=5),
    ]
    g = torch.Generator().manual_seed(5)
    rows = 240
    logits = torch.randn(rows, 3000, generator=g) * torch.tensor([4.0, 1.0, 0.3, 8.0, 2.0]).repeat(rows // 5).unsqueeze(1)  # every kind at each scale
    logits[7:11, :40] = 2.5  # ties among the largest
    params = [kinds[i % len(kinds)] for i in range(rows)]
    uniforms = torch.rand(rows, generator=g, dtype=torch.float64)
    uniforms[:6], uniforms[6:12] = 0.0, 1.0  # 1: a rounding edge, kept off the filtered tail
    probs, candidates = _top_k_candidates(logits, params)
    want = candidates.gather(1, _inverse_cdf_no_sync(probs, uniforms).unsqueeze(1)).squeeze(1)
    top, ids = logits.topk(candidates.shape[1], dim=-1)
    got = draw_among_top_k(top, ids, [max(p.temperature, 1e-30) for p in params], [p.top_k for p in params], [p.top_p for p in params],
                           [p.min_p for p in params], uniforms)
    assert torch.equal(got, want)
    kept = [set(c[p > 0].tolist()) for c, p in zip(candidates, probs)]
    assert all(token in row for token, row in zip(got.tolist(), kept)), "a token the filters remove was drawn"
    assert len(set(got[1::len(kinds)].tolist())) > 10, "top-k 50 rows draw many tokens"


@under_interpreter
def test_the_samplers_top_k_rows_draw_through_the_one_launch_as_through_the_torch_ops(monkeypatch):
    """Sampler._draw_on_device with the top-k kernel (as on CUDA) gives the tokens it gives with
    the torch ops, for the same engine seed: unkeyed and keyed rows, mixed k, a temperature below
    the floor and one above the ceiling, a top_p below the floor."""
    import engine.sampler
    from engine import SamplingParams
    from engine.sampler import Sampler

    kinds = [SamplingParams(temperature=0.7, top_k=20, top_p=0.8), SamplingParams(temperature=1e-40, top_k=5),
             SamplingParams(temperature=1e35, top_k=30, min_p=0.1), SamplingParams(temperature=1.1, top_k=12, top_p=1e-45)]
    params = [kinds[i % len(kinds)] for i in range(32)]
    keys = [None if i % 3 else 1000 + i for i in range(32)]
    logits = torch.randn(32, 2000, generator=torch.Generator().manual_seed(8)) * 3
    want = Sampler(seed=5)._draw_on_device(logits, params, keys)
    monkeypatch.setattr(engine.sampler, "_fused_top_k_draws", lambda logits: True)
    got = Sampler(seed=5)._draw_on_device(logits, params, keys)
    assert torch.equal(got, want)
