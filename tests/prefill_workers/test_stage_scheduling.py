"""A pipeline stage's prompt in the prefill actor's scheduler: its blocks taken at once, its
prefix-cache entries salted with its layers (never found by a prompt that needs every layer),
its cached prefix trimmed to where the pipeline starts, and every block given back."""

from __future__ import annotations

import time

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.block_allocator import OutOfBlocksError
from engine.scheduler import ScheduledBatch, ScheduledSlice
from prefill_workers.scheduler import PrefillScheduler
from tests.checkpoints import build_checkpoint, random_prompts

NUM_BLOCKS = 32


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("stage_sched")
    build_checkpoint("llama", path)
    return path


def _engine(model_path) -> LLMEngine:
    return LLMEngine(model_path, EngineConfig(num_kv_blocks=NUM_BLOCKS, dtype="float32"), scheduler_cls=PrefillScheduler)


def _run_first_stage(engine: LLMEngine, req_id: str, prompt: list[int], salt: bytes = b"layers:0-1", chunk: int = 16) -> int:
    """Stage [0, 1) of a 2-layer model over the whole prompt; returns the cached tokens it started from."""
    seq = engine.make_sequence(req_id, prompt, SamplingParams(max_tokens=1))
    engine.scheduler.add_stage(seq, salt)
    cached = seq.num_computed_tokens
    engine.scheduler.start_stage_at(seq, cached)
    while seq.num_computed_tokens < len(prompt):
        n = min(chunk, len(prompt) - seq.num_computed_tokens)
        engine.run_stage(ScheduledBatch([ScheduledSlice(seq, n)]), range(0, 1), None)
    assert req_id in engine.scheduler.held and req_id not in engine.scheduler.staged
    engine.scheduler.release(req_id)
    return cached


def test_a_stage_caches_its_layers_under_its_own_salt(model_path):
    engine = _engine(model_path)
    prompt = random_prompts([70], engine.model_config.vocab_size, seed=3)[0]
    assert _run_first_stage(engine, "a", prompt) == 0
    assert engine.num_free_blocks == NUM_BLOCKS  # every block back (cached ones are free to take)
    # The same stage sees its four full blocks again.
    assert _run_first_stage(engine, "b", prompt) == 64
    # Another stage's layers, or a prompt that needs every layer, never hit them.
    assert _run_first_stage(engine, "c", prompt, salt=b"layers:1-2") == 0
    whole = engine.add_request("d", prompt, SamplingParams(max_tokens=1))
    engine.step()
    assert whole.num_cached_tokens == 0


def test_the_cached_prefix_is_trimmed_to_where_the_pipeline_starts(model_path):
    engine = _engine(model_path)
    prompt = random_prompts([70], engine.model_config.vocab_size, seed=4)[0]
    _run_first_stage(engine, "a", prompt)
    seq = engine.make_sequence("b", prompt, SamplingParams(max_tokens=1))
    engine.scheduler.add_stage(seq, b"layers:0-1")
    cached_ids = list(seq.block_table[:4])
    assert seq.num_computed_tokens == 64
    engine.scheduler.start_stage_at(seq, 32)  # another stage holds only two blocks
    assert seq.num_computed_tokens == 32 and seq.block_table[:2] == cached_ids[:2]
    # The blocks past the start are this sequence's own now (it rewrites them): none is shared.
    assert all(engine.allocator.ref_count(b) == 1 for b in seq.block_table)
    assert len(seq.block_hashes) == 2 and seq.num_cached_tokens == 32
    engine.abort_request("b")
    assert engine.num_free_blocks == NUM_BLOCKS and "b" not in engine.scheduler.staged


def test_a_pipeline_start_without_room_for_its_fresh_blocks_changes_nothing(model_path):
    """Starting a stage before the end of its cached prefix gives those blocks back for fresh
    ones. It freed them first: where another prompt shared them nothing came free, the
    allocation raised, and the table still named blocks it no longer held, freed again when the
    stage was cancelled (another prompt's KV handed out; an assertion on the engine thread)."""
    engine = _engine(model_path)
    prompt = random_prompts([70], engine.model_config.vocab_size, seed=6)[0]
    _run_first_stage(engine, "a", prompt)
    stages = [engine.make_sequence(req_id, prompt, SamplingParams(max_tokens=1)) for req_id in ("b", "c")]
    for seq in stages:
        engine.scheduler.add_stage(seq, b"layers:0-1")  # both hold the four cached blocks
    filler = engine.make_sequence("filler", random_prompts([engine.num_free_blocks * 16], engine.model_config.vocab_size, seed=7)[0], SamplingParams(max_tokens=1))
    engine.scheduler.add_stage(filler, b"layers:0-1")
    assert engine.num_free_blocks == 0
    table = list(stages[0].block_table)
    with pytest.raises(OutOfBlocksError):
        engine.scheduler.start_stage_at(stages[0], 32)
    assert stages[0].block_table == table and stages[0].num_computed_tokens == 64
    for req_id in ("b", "c", "filler"):
        engine.abort_request(req_id)
    assert engine.num_free_blocks == NUM_BLOCKS


def test_a_stage_that_does_not_fit_keeps_nothing(model_path):
    engine = _engine(model_path)
    prompt = random_prompts([NUM_BLOCKS * 16 + 5], engine.model_config.vocab_size, seed=5)[0]
    seq = engine.make_sequence("big", prompt[: NUM_BLOCKS * 16 - 1], SamplingParams(max_tokens=1))
    engine.scheduler.add_stage(seq, b"layers:0-1")
    other = engine.make_sequence("other", prompt[:40], SamplingParams(max_tokens=1))
    with pytest.raises(OutOfBlocksError, match="needs 3 free KV blocks, 0 are"):
        engine.scheduler.add_stage(other, b"layers:0-1")
    assert "other" not in engine.scheduler.requests and not other.block_table
    engine.abort_request("big")
    assert engine.num_free_blocks == NUM_BLOCKS


# -- a stage job on the prefill actor: what ends it -------------------------------------------


def _stage_worker(engine: LLMEngine, req_id: str, prompt: list[int], stage, lease_s: float = 30.0):
    """A prefill actor's stage job, started at token 0, on a worker made of only what a stage's
    chunk loop uses: the real engine and scheduler, no NIXL (activations over Ray), an agent that
    notes cancels."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from kvtransfer.messages import KVDestination, PeerRef
    from prefill_workers.messages import PrefillRequest
    from prefill_workers.worker import PrefillWorker, _Job

    seq = engine.make_sequence(req_id, prompt, SamplingParams(max_tokens=1))
    engine.scheduler.add_stage(seq, stage.salt)
    engine.scheduler.start_stage_at(seq, 0)
    worker = object.__new__(PrefillWorker)
    worker.engine, worker.scheduler, worker.activations, worker.worker_id = engine, engine.scheduler, None, "prefill-t"
    worker.cancels, worker._num_stage_chunks_over_ray, worker._num_stage_chunks_over_nixl = [], 0, 0
    worker.agent = SimpleNamespace(cancel=lambda req, token: worker.cancels.append((req, token)))
    destination = KVDestination(req_id, PeerRef("decode-t", "e1"), [1, 2, 3], time.time() + lease_s, token=7)
    request = PrefillRequest(req_id, prompt, SamplingParams(max_tokens=1), destination, decode_offer=None, stage=stage)
    job = _Job(request, seq, Future(), time.monotonic(), num_pushed_blocks=0, started=True)
    worker._jobs = {req_id: job}
    return worker, job


def test_a_started_stage_waiting_past_its_lease_ends_and_gives_back_its_blocks(model_path):
    """A later stage waits for the stage before it; the router renews every stage's lease while
    the request is in flight. When its router dies mid-prompt the stage before ends (its push
    is refused) and no activations come: the waiting stage must end once its lease runs out,
    not hold the prompt's blocks for good."""
    from prefill_workers.worker import PrefillCancelledError
    from workers.pipeline import PipelineStage

    engine = _engine(model_path)
    prompt = random_prompts([40], engine.model_config.vocab_size, seed=6)[0]
    worker, job = _stage_worker(engine, "r", prompt, PipelineStage(1, 2, 1, 2))
    assert engine.num_free_blocks < NUM_BLOCKS
    assert worker._run_stage_chunk() is False and "r" in worker._jobs  # within its lease: it waits
    job.request.destination.lease_deadline = time.time() - 1
    worker._run_stage_chunk()
    assert "r" not in worker._jobs and isinstance(job.done.exception(timeout=0), PrefillCancelledError)
    assert worker.cancels == [("r", 7)] and engine.num_free_blocks == NUM_BLOCKS


def test_a_chunk_that_cannot_be_handed_on_fails_its_request_not_the_actor(model_path):
    """Handing a chunk's activations to the next stage can fail (a GPU's tensors once could not
    cross Ray at all): that request fails, and the actor's loop goes on."""
    from engine.errors import RequestFailedError
    from types import SimpleNamespace
    from workers.pipeline import PipelineStage

    def refuse(chunk):
        raise RuntimeError("the next stage's handle is gone")

    engine = _engine(model_path)
    prompt = random_prompts([40], engine.model_config.vocab_size, seed=7)[0]
    next_stage = SimpleNamespace(stage_activations=SimpleNamespace(remote=refuse))
    worker, job = _stage_worker(engine, "h", prompt, PipelineStage(0, 2, 0, 1, next_stage=next_stage, chunk_tokens=16))
    assert worker._run_stage_chunk() is True
    failure = job.done.exception(timeout=0)
    assert "h" not in worker._jobs and isinstance(failure, RequestFailedError) and "handle is gone" in str(failure)
    assert engine.num_free_blocks == NUM_BLOCKS


@pytest.mark.parametrize("router_alive", [True, False])
def test_a_stage_answers_only_once_the_next_stage_has_every_chunk(model_path, router_alive):
    """A stage answered once its KV landed, with its last chunk's activations still on their way
    to the next stage; dying then, it left that stage waiting for good (the router renews every
    stage's lease while the request is in flight, and its call had returned). Now its answer
    waits for every chunk's hand-on (here over Ray: the calls' returns), so a death before is a
    failed stage call, which the router places again. A call that raised counts as returned (the
    next stage is gone: the router hears it from that stage's own call). One whose lease runs
    out while it waits (its router is gone, a write hangs) ends, its blocks given back."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from kvtransfer.messages import SendEvent
    from workers.pipeline import PipelineStage

    handed_on: list[Future] = []

    def stage_activations(chunk):
        returned = Future()
        handed_on.append(returned)
        return SimpleNamespace(future=lambda: returned)

    engine = _engine(model_path)
    prompt = random_prompts([40], engine.model_config.vocab_size, seed=8)[0]
    next_stage = SimpleNamespace(stage_activations=SimpleNamespace(remote=stage_activations))
    worker, job = _stage_worker(engine, "s", prompt, PipelineStage(0, 2, 0, 1, next_stage=next_stage, chunk_tokens=16))
    job.request.destination.block_ids = list(range(1, 4))  # the prompt's 3 blocks
    pushed, landed = [], []
    worker.agent.push = lambda req_id, dest, src, dst, num_valid, payload, layers: pushed.append(len(pushed)) or pushed[-1]
    worker.agent.write_cost = lambda dest, src, dst, layers: (1, 1)
    worker.pump = SimpleNamespace(kick=lambda: None, take_send_events=lambda: [landed.pop() for _ in list(landed)])
    worker.step_log = SimpleNamespace(record_transfer=lambda record: None)
    worker._step_delay_s, worker._thread, worker.block_size = 0.0, SimpleNamespace(wake=lambda: None), engine.kv_cache.block_size
    while worker._run_stage_chunk():
        pass
    assert len(handed_on) == 3 and job.prefilled_at is not None and job.all_pushed
    landed += [SendEvent("s", "decode-t", seq, 3, token=7) for seq in pushed]
    worker._poll_sends()
    assert not job.writes_in_flight and not job.done.done() and "s" in worker._jobs, "its KV landed, its last chunk is on its way"
    handed_on[0].set_result(None)
    handed_on[1].set_exception(RuntimeError("the next stage died"))
    assert worker._finish_if_done(job) is False and not job.done.done()
    if not router_alive:
        from prefill_workers.worker import PrefillCancelledError

        job.request.destination.lease_deadline = time.time() - 1
        assert worker._finish_if_done(job) is True and isinstance(job.done.exception(timeout=0), PrefillCancelledError)
        assert "s" not in worker._jobs and worker.cancels == [("s", 7)] and engine.num_free_blocks == NUM_BLOCKS
        return
    handed_on[2].set_result(None)
    assert worker._finish_if_done(job) is True
    assert job.done.result(timeout=0).first_token_id is None and "s" not in worker._jobs


def test_a_prompt_being_prefilled_is_never_preempted_for_one_that_does_not_fit(model_path):
    """A prefill actor pushes a prompt's finished blocks while its later chunks run. A waiting
    prompt of higher priority that does not fit must not preempt it (its blocks went to the new
    prompt while a write still read them: the decode actor got another prompt's KV); the running
    prompt goes on, and once it is held and released the waiting one runs."""
    config = EngineConfig(num_kv_blocks=10, block_size=4, max_num_batched_tokens=8, long_prefill_chunk=8, dtype="float32")
    engine = LLMEngine(model_path, config, scheduler_cls=PrefillScheduler)
    scheduler = engine.scheduler
    first, second = random_prompts([32, 24], engine.model_config.vocab_size, seed=7)
    engine.add_request("A", first, SamplingParams(max_tokens=1))
    engine.step()
    a = scheduler.requests["A"]
    table = list(a.block_table)
    assert len(table) == 8 and a.num_computed_tokens == 8
    engine.add_request("B", second, SamplingParams(max_tokens=1), priority=5)
    batch = scheduler.schedule()
    assert batch.preempted_req_ids == [] and [(s.seq.req_id, s.num_tokens) for s in batch.slices] == [("A", 8)]
    assert a.block_table == table


def test_a_blocked_prompt_that_scores_its_tokens_takes_no_scoring_room_from_a_running_one(model_path):
    """Prompt log-probabilities are computed in bounded rows per step. A waiting prompt that asks
    for them but cannot get its blocks took that room before it was found blocked, and the
    running prompt behind it (asking too) got an empty step, every step: nothing moved."""
    config = EngineConfig(num_kv_blocks=10, block_size=4, max_num_batched_tokens=8, long_prefill_chunk=8, dtype="float32")
    engine = LLMEngine(model_path, config, scheduler_cls=PrefillScheduler)
    scheduler = engine.scheduler
    scheduler.max_scored_rows = 8
    first, second = random_prompts([32, 24], engine.model_config.vocab_size, seed=8)
    engine.add_request("A", first, SamplingParams(max_tokens=1, prompt_logprobs=0))
    engine.step()
    engine.add_request("B", second, SamplingParams(max_tokens=1, prompt_logprobs=0), priority=5)
    batch = scheduler.schedule()
    assert [(s.seq.req_id, s.num_tokens) for s in batch.slices] == [("A", 8)]
