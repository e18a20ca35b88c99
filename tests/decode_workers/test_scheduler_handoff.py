"""The prefill and decode scheduling policies hand a request over exactly.

Blocks are copied between the two engines' caches in-process here (the real actors push
them over NIXL); what this checks is the seam: a decode engine that admits a sequence
whose KV another engine computed continues it token for token like transformers.
"""

from __future__ import annotations

import asyncio

import pytest

from decode_workers.scheduler import DecodeScheduler
from engine import EngineConfig, LLMEngine, SamplingParams
from prefill_workers.scheduler import PrefillScheduler
from tests.checkpoints import build_checkpoint, hf_greedy, random_prompts


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("handoff")
    return path, build_checkpoint("qwen3", path)


@pytest.mark.parametrize("chunk", [7, 64])
def test_prefill_then_remote_decode_matches_transformers(checkpoint, chunk):
    path, model = checkpoint
    prompts = random_prompts([5, 40, 100], model.config.vocab_size, seed=3)
    expected = [hf_greedy(model, p, 10) for p in prompts]
    prefill = LLMEngine(path, EngineConfig(num_kv_blocks=64, long_prefill_chunk=chunk, max_num_batched_tokens=chunk), scheduler_cls=PrefillScheduler)
    decode = LLMEngine(path, EngineConfig(num_kv_blocks=64), scheduler_cls=DecodeScheduler)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    destinations = {}
    for i, prompt in enumerate(prompts):
        seq = decode.make_sequence(f"r{i}", prompt, params)
        destinations[seq.req_id] = decode.scheduler.reserve(seq).block_ids
        prefill.add_request(f"r{i}", prompt, params)
    first_tokens = {}
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            first_tokens[out.req_id] = out.new_token_ids[0]
    assert decode.num_free_blocks < 64
    for req_id, dst in destinations.items():
        src = prefill.scheduler.held[req_id].block_table
        decode.kv_cache.tensor[dst] = prefill.kv_cache.tensor[src]
        prefill.scheduler.release(req_id)
        decode.scheduler.admit_remote(req_id, first_tokens[req_id])
    assert prefill.num_free_blocks == 64
    tokens = {req_id: [tok] for req_id, tok in first_tokens.items()}
    while decode.has_unfinished_requests():
        for out in decode.step():
            tokens[out.req_id].extend(out.new_token_ids)
    assert [tokens[f"r{i}"] for i in range(3)] == expected
    assert decode.num_free_blocks == 64


def test_aborting_a_reservation_returns_its_blocks(checkpoint):
    path, _ = checkpoint
    decode = LLMEngine(path, EngineConfig(num_kv_blocks=16, block_size=16), scheduler_cls=DecodeScheduler)
    seq = decode.make_sequence("r", list(range(3, 51)), SamplingParams(max_tokens=4))
    assert len(decode.scheduler.reserve(seq).block_ids) == 3  # 48 prompt tokens: 3 full blocks written by prefill
    assert decode.num_free_blocks == 12  # plus one of headroom for the first decode token
    big = decode.make_sequence("big", list(range(3, 196)), SamplingParams(max_tokens=1))
    assert decode.scheduler.reserve(big) is None, "a reservation larger than the free pool is refused"
    assert decode.num_free_blocks == 12
    decode.abort_request("r")
    assert decode.num_free_blocks == 16


def test_sampled_token_survives_its_json_form():
    from engine.sequence import TokenLogprob, sampled_token_from_json, sampled_token_to_json

    logprob = TokenLogprob(42, -0.25, 1, [(42, -0.25), (7, -1.5)])
    assert sampled_token_from_json(sampled_token_to_json(42, logprob)) == (42, logprob)
    assert sampled_token_from_json(sampled_token_to_json(9, None)) == (9, None)


# -- prefix caching across the handoff ----------------------------------------------------

BLOCK = 16


def _engines(path, prefill_cache: bool, decode_cache: bool, num_blocks: int = 64):
    prefill = LLMEngine(
        path,
        EngineConfig(num_kv_blocks=num_blocks, block_size=BLOCK, long_prefill_chunk=24, max_num_batched_tokens=48, enable_prefix_caching=prefill_cache),
        scheduler_cls=PrefillScheduler,
    )
    decode = LLMEngine(path, EngineConfig(num_kv_blocks=num_blocks, block_size=BLOCK, enable_prefix_caching=decode_cache), scheduler_cls=DecodeScheduler)
    return prefill, decode


def _handoff(prefill, decode, req_id, prompt, max_tokens=8):
    """One request through both engines, blocks copied as the prefill actor pushes them: only
    the prompt blocks the decode reservation asks for. Returns (output, computed, pushed)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    seq = decode.make_sequence(req_id, prompt, params)
    remote = decode.scheduler.reserve(seq)
    held = seq.block_table[: remote.num_cached_blocks]
    assert all(decode.allocator.ref_count(b) == 1 for b in remote.block_ids), "a written block is nobody else's"
    assert not set(held) & set(remote.block_ids)
    computed_before = prefill.num_scheduled_tokens
    prefill_seq = prefill.add_request(req_id, prompt, params)
    first = None
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            first = out.new_token_ids[0]
    src = prefill.scheduler.held[req_id].block_table[remote.num_cached_blocks :]
    assert len(src) == len(remote.block_ids)
    decode.kv_cache.tensor[remote.block_ids] = prefill.kv_cache.tensor[src]
    prefill.scheduler.release(req_id)
    decode.scheduler.admit_remote(req_id, first)
    tokens = [first]
    while decode.has_unfinished_requests():
        for out in decode.step():
            tokens.extend(out.new_token_ids)
    computed = prefill.num_scheduled_tokens - computed_before
    assert computed == len(prompt) - (prefill_seq.num_cached_tokens or 0)
    return tokens, computed, len(remote.block_ids)


@pytest.mark.parametrize("prefill_cache, decode_cache", [(True, True), (False, True), (True, False)])
def test_a_shared_prefix_is_computed_once_and_sent_once_on_either_side(checkpoint, prefill_cache, decode_cache):
    path, model = checkpoint
    base, s1, s2 = random_prompts([70, 9, 30], model.config.vocab_size, seed=8)
    prefill, decode = _engines(path, prefill_cache, decode_cache)
    first, second = base + s1, base + s2  # 79 and 100 tokens: 5 and 7 blocks
    out1, computed1, pushed1 = _handoff(prefill, decode, "a", first)
    out2, computed2, pushed2 = _handoff(prefill, decode, "b", second)
    assert out1 == hf_greedy(model, first, 8)
    assert out2 == hf_greedy(model, second, 8)
    assert (computed1, pushed1) == (79, 5)
    shared_blocks = 70 // BLOCK  # 4 full blocks of the base
    assert computed2 == (100 - shared_blocks * BLOCK if prefill_cache else 100)
    assert pushed2 == (7 - shared_blocks if decode_cache else 7)
    assert prefill.num_free_blocks == decode.num_free_blocks == 64


def test_a_decode_hit_is_held_while_the_prompt_waits_and_a_prefill_hit_evicted_meanwhile_is_recomputed(checkpoint):
    path, model = checkpoint
    base, s1, s2, other = random_prompts([64, 5, 7, 215], model.config.vocab_size, seed=9)
    prefill, decode = _engines(path, True, True, num_blocks=14)
    _handoff(prefill, decode, "warm", base + s1)  # both caches now hold the 4 blocks of base
    # The decode actor reserves: its 4 cached blocks are held, not just found.
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    seq = decode.make_sequence("late", base + s2, params)
    remote = decode.scheduler.reserve(seq)
    assert remote.num_cached_blocks == 4 and len(remote.block_ids) == 1
    # While it waits, another request takes every other decode block: the held ones survive.
    hog = decode.make_sequence("hog", other[:140], params)
    assert decode.scheduler.reserve(hog) is not None
    assert decode.num_free_blocks == 0
    # On the prefill side, a prompt that needs every block runs first and evicts the cached base.
    prefill.add_request("other", other, params)
    while prefill.has_unfinished_requests():
        prefill.step()
    prefill.scheduler.release("other")
    prefill_seq = prefill.add_request("late", base + s2, params)
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            first = out.new_token_ids[0]
    assert prefill_seq.num_cached_tokens == 0, "the evicted base was computed again"
    src = prefill.scheduler.held["late"].block_table[4:]
    decode.kv_cache.tensor[remote.block_ids] = prefill.kv_cache.tensor[src]
    prefill.scheduler.release("late")
    decode.abort_request("hog")
    decode.scheduler.admit_remote("late", first)
    tokens = [first]
    while decode.has_unfinished_requests():
        for out in decode.step():
            tokens.extend(out.new_token_ids)
    assert tokens == hf_greedy(model, base + s2, 8)
    assert prefill.num_free_blocks == decode.num_free_blocks == 14


def test_a_local_prompt_is_not_starved_by_a_stream_of_remote_admissions(checkpoint):
    """Remote sequences join the batch whatever max_num_seqs says, and a local prompt (or a
    preempted sequence, recomputed here) only starts below it: with new reservations placed
    whenever the actor reported room, the batch stayed full and the local prompt never started.
    While one waits for a seat, the actor now reports no room, and it starts once the batch
    thins."""
    path, model = checkpoint
    decode = LLMEngine(path, EngineConfig(num_kv_blocks=64, max_num_seqs=2), scheduler_cls=DecodeScheduler)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompts = random_prompts([12] * 40, model.config.vocab_size, seed=9)

    def admit_remote(index: int) -> None:  # the KV's values do not matter here, only the seats
        seq = decode.make_sequence(f"remote-{index}", prompts[index], params)
        assert decode.scheduler.reserve(seq) is not None
        decode.scheduler.admit_remote(seq.req_id, 5)

    admit_remote(0)
    admit_remote(1)
    decode.add_request("local", prompts[-1], params)
    # Just come, it holds remote admissions back for nothing (conditional disaggregation sends
    # local prompts all the time); past its patience (none here) it does.
    assert decode.scheduler.num_reservable_blocks() > 0
    decode.scheduler.waiting_patience_s = 0.0
    admitted, local_done = 2, False
    for _ in range(30):  # the router places a reservation wherever the actor reports room
        if admitted < 38 and decode.scheduler.num_reservable_blocks() >= decode.scheduler.blocks_for_remote(decode.make_sequence("probe", prompts[0], params)):
            admit_remote(admitted)
            admitted += 1
        local_done |= any(out.req_id == "local" and out.finished for out in decode.step())
        if local_done:
            break
    assert local_done, "the local prompt never got a seat"


def test_a_lease_failure_and_the_free_of_its_blocks_taken_at_once_end_the_request_and_free_the_blocks(checkpoint):
    """A reservation whose lease ran out gives a failure, then (after the grace) the free of its
    blocks: an engine thread that took both in one batch freed first, the blocks still the
    waiting request's, and the free raised on the engine thread (the actor replaced, every
    stream on it restarted)."""
    from types import SimpleNamespace

    from decode_workers.worker import DecodeWorker, OutputBox
    from kvtransfer.errors import RequestTransferError
    from kvtransfer.messages import FreedBlocks, ReceiveEvents

    path, _ = checkpoint
    decode = LLMEngine(path, EngineConfig(num_kv_blocks=16, block_size=16), scheduler_cls=DecodeScheduler)
    seq = decode.make_sequence("r", list(range(3, 51)), SamplingParams(max_tokens=4))
    blocks = list(decode.scheduler.reserve(seq).block_ids)
    events = ReceiveEvents(failed=[RequestTransferError("r", "P", "lease ran out with 1/3 blocks landed")], freed=[FreedBlocks("r", blocks, "lease expired")])
    worker = SimpleNamespace(
        pump=SimpleNamespace(take_receive_events=lambda: events, kick=lambda: None), scheduler=decode.scheduler, _outputs=OutputBox(),
        _tracked={"r": SimpleNamespace(router_id="router", attempt=0, dest_block_ids=blocks)}, activations=None,
        agent=SimpleNamespace(abort=lambda req_id, given_up=False: []),  # the receiver forgot it: nothing safe at once
        worker_id="decode-0",
    )
    worker._fail = lambda req_id, message: DecodeWorker._fail(worker, req_id, message)
    worker._drop_reservation = lambda req_id, tracked: DecodeWorker._drop_reservation(worker, req_id, tracked)
    assert DecodeWorker._poll_transfers(worker)
    assert "r" not in decode.scheduler.awaiting_kv and not decode.scheduler.detached_blocks
    assert decode.num_free_blocks == 16
    (failed,) = asyncio.run(worker._outputs.take("router", 0.01))
    assert failed.req_id == "r" and failed.finish_reason == "error" and "lease ran out" in failed.error  # the router places it again
