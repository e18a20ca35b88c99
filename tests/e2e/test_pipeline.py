"""Distributed split-fuse through a real deployment: one prompt prefilled by a pipeline of
prefill actors (each a range of layers, activations passed stage to stage, each stage pushing its
layers of every block into the decode actor's reservation) gives exactly transformers' greedy
output, for two and three stages, chunk sizes that do and do not divide the prompt, prefix-cache
hits on every stage, a quantized cache, stages that are tensor-parallel groups, and a stage killed
mid-prompt."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import grpc
import pytest
import ray
import torch

from engine import LLMEngine, SamplingParams
from kvtransfer.agent import KVTransferConfig
from router.config import Disaggregation, RouterConfig
from router.pipeline import PipelineMode
from router.pool import RoutingPolicy
from tests.checkpoints import build_checkpoint, hf_greedy, random_prompts
from tests.serving import Client, engine_config, following_router, make_request, running_deployment

pytestmark = pytest.mark.e2e

NUM_LAYERS = 4


@pytest.fixture(scope="module")
def four_layer_model(tmp_path_factory):
    """The e2e model's tokenizer over a 4-layer llama (stages of 1, 2 or 3 layers)."""
    from tests.conftest import E2EModel
    from tests.router.tokenizer_builders import BASE_CONFIG, save_model_dir, train_byte_level_bpe

    path = tmp_path_factory.mktemp("pipeline_model")
    tokenizer = train_byte_level_bpe(400)
    model = build_checkpoint("llama", path, vocab_size=tokenizer.get_vocab_size(), max_position_embeddings=2048, num_hidden_layers=NUM_LAYERS)
    save_model_dir(path, tokenizer, BASE_CONFIG)
    return E2EModel(path, model, tokenizer.get_vocab_size())


@pytest.fixture(scope="module")
def shared_workers(ray_cluster, four_layer_model):
    """Three prefill actors and a decode actor, durable, for the tests that kill nothing and need
    no engine or transfer setting of their own: each routes through a router of its own
    configuration that follows these workers (``following_router``), the stages it wants picked
    by ``max_pipeline_stages`` (idle actors in id order)."""
    with running_deployment(four_layer_model, 3, 1, _router(32), name="pipeline-shared", durable_workers=True) as deployment:
        yield deployment


def _router(chunk_tokens: int, **overrides) -> RouterConfig:
    """Every prompt pipelined over prefill actors only (``pipeline_decode_stage``: ALWAYS adds the decode actor as the last stage)."""
    fields = dict(
        disaggregation=Disaggregation.ALWAYS, prefill_pipeline=PipelineMode.ALWAYS, pipeline_chunk_tokens=chunk_tokens,
        pipeline_decode_stage=PipelineMode.OFF,
    )
    fields.update(overrides)
    return RouterConfig(**fields)


def _stage_workers(stream) -> list[str]:
    return stream.last.prefill_worker_id.split(",")


@pytest.mark.parametrize("num_prefill,chunk_tokens", [(2, 16), (3, 23)])
def test_a_pipelined_prompt_decodes_what_transformers_does(shared_workers, four_layer_model, num_prefill, chunk_tokens):
    prompts = random_prompts([40, 97, 200], four_layer_model.vocab_size, seed=num_prefill)
    expected = [hf_greedy(four_layer_model.hf_model, p, 8) for p in prompts]
    with following_router(shared_workers, _router(chunk_tokens, max_pipeline_stages=num_prefill)) as deployment:
        client = Client(deployment.address)
        streams = [client.generate(prompt_token_ids=p, max_tokens=8, temperature=0.0, ignore_eos=True) for p in prompts]
        for stream, want in zip(streams, expected):
            assert stream.token_ids == want
            assert len(_stage_workers(stream)) == num_prefill, stream.last.prefill_worker_id
            # Every stage pushed its layers of every block: the bytes of the whole prompt's KV.
            assert stream.last.timing.kv_bytes_transferred > 0
        # The chunks' activations went into the next stage's memory over NIXL (a chunk may go over
        # Ray where every staging slot still has a write in flight: these stages are very fast).
        statuses = [ray.get(deployment.pools.handles[f"prefill-{i}"].status.remote()) for i in range(num_prefill - 1)]
        assert all(s.num_stage_chunks_over_nixl > s.num_stage_chunks_over_ray for s in statuses), statuses
        # The same prompts again: each stage's own prefix cache (of its layers) holds them.
        again = [client.generate(prompt_token_ids=p, max_tokens=8, temperature=0.0, ignore_eos=True) for p in prompts]
        for stream, want, prompt in zip(again, expected, prompts):
            assert stream.token_ids == want
            assert stream.last.timing.prompt_tokens_computed < len(prompt)
        assert all(w.num_kv_blocks_used == 0 for w in client.wait_until_idle())
        client.close()


def test_a_prompt_whose_chunks_fill_the_inbox_exactly_hands_them_on_over_nixl(shared_workers, four_layer_model):
    """Its 16 chunks (512 tokens of 32) in the next stage's 16 slots: one slot more was asked for
    (a chunk "split" by a cached prefix, which never happens), so an 8k prompt in 512-token
    chunks, the default, sent every chunk over Ray."""
    from workers.pipeline import inbox_chunks

    assert inbox_chunks(8192, 512) == KVTransferConfig().stage_inbox_slots == 16
    prompt = random_prompts([512], four_layer_model.vocab_size, seed=41)[0]
    with following_router(shared_workers, _router(32, max_pipeline_stages=2)) as deployment:
        client = Client(deployment.address)
        before = ray.get(deployment.pools.handles["prefill-0"].status.remote())
        stream = client.generate(prompt_token_ids=prompt, max_tokens=4, temperature=0.0, ignore_eos=True)
        assert stream.token_ids == hf_greedy(four_layer_model.hf_model, prompt, 4)
        assert _stage_workers(stream) == ["prefill-0", "prefill-1"]
        after = ray.get(deployment.pools.handles["prefill-0"].status.remote())
        over_nixl, over_ray = (after.num_stage_chunks_over_nixl - before.num_stage_chunks_over_nixl,
                               after.num_stage_chunks_over_ray - before.num_stage_chunks_over_ray)
        assert over_nixl + over_ray == 16 and over_nixl > over_ray, (over_nixl, over_ray)
        client.wait_until_idle()
        client.close()


def test_a_scored_prompt_is_prefilled_by_one_actor_where_every_prompt_is_pipelined(shared_workers, four_layer_model):
    """Over gRPC, with every remote prompt pipelined: a prompt whose log-probabilities are asked
    for is prefilled by one prefill actor (whose engine bounds the rows a step scores; a
    pipeline's chunks would not), which scores every position of it."""
    (prompt,) = random_prompts([90], four_layer_model.vocab_size, seed=90)
    with torch.no_grad():
        reference = torch.log_softmax(four_layer_model.hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    with following_router(shared_workers, _router(16, max_pipeline_stages=2, pipeline_decode_stage=PipelineMode.ALWAYS)) as deployment:
        client = Client(deployment.address)
        stream = client.generate(prompt_token_ids=prompt, max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
        assert stream.token_ids == hf_greedy(four_layer_model.hf_model, prompt, 4)
        assert len(_stage_workers(stream)) == 1, stream.last.prefill_worker_id
        assert client.generate(prompt_token_ids=prompt, max_tokens=1, temperature=0.0).last.prefill_worker_id.count(",") == 1  # unscored: 2 stages
        first, *rest = stream.messages
        assert not any(m.prompt_logprobs for m in rest)
        entries = first.prompt_logprobs
        assert [e.token_id for e in entries] == prompt[1:]
        for position, entry in enumerate(entries):
            row = reference[position]
            assert entry.logprob == pytest.approx(row[prompt[position + 1]].item(), abs=1e-3)
            assert entry.rank == int((row > row[prompt[position + 1]]).sum()) + 1
            assert [t.token_id for t in entry.top] == row.topk(3).indices.tolist()
        assert stream.last.timing.prompt_tokens_computed == len(prompt)
        assert all(w.num_kv_blocks_used == 0 for w in client.wait_until_idle())
        client.close()


@pytest.mark.parametrize("decode_stage", [PipelineMode.OFF, PipelineMode.ALWAYS])
def test_allowed_token_ids_that_leave_a_pipelined_prompts_grammar_nothing_are_refused(shared_workers, four_layer_model, decode_stage):
    """Only "9" allowed against the regex "ab": no first token has an honest draw. Where the
    prompt is pipelined (its last stage on a prefill actor, or on the decode actor), the request is
    refused naming allowed_token_ids before anything is computed (the last stage once drew the
    forbidden token), nothing is left behind, and the next pipelined prompt is exact."""
    from tokenizers import Tokenizer

    from router.api.pdserve.v1 import generation_pb2 as pb

    nine = Tokenizer.from_file(str(four_layer_model.path / "tokenizer.json")).token_to_id("9")
    prompt, after = random_prompts([60, 70], four_layer_model.vocab_size, seed=41)
    router = _router(16, max_pipeline_stages=2, pipeline_decode_stage=decode_stage)
    with following_router(shared_workers, router) as deployment:
        client = Client(deployment.address)
        request = make_request(prompt_token_ids=prompt, max_tokens=4, temperature=0.0, allowed_token_ids=[nine],
                               structured_output=pb.StructuredOutput(regex="ab"))
        with pytest.raises(grpc.RpcError) as info:
            list(client.stub.Generate(request))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "allowed_token_ids" in info.value.details(), info.value.details()
        assert all(w.num_kv_blocks_used == 0 for w in client.wait_until_idle())
        stream = client.generate(prompt_token_ids=after, max_tokens=6, temperature=0.0, ignore_eos=True)
        assert stream.token_ids == hf_greedy(four_layer_model.hf_model, after, 6) and len(_stage_workers(stream)) == 2
        client.close()


def test_a_seeded_sample_repeats_and_concurrent_pipelines_share_the_actors(ray_cluster, four_layer_model):
    """Four pipelines at once over the same two actors. The second stage's inbox has room for one
    prompt's chunks at a time (8 slots; the 150-token prompt takes 5), so the others' activations
    go over Ray: both ways give transformers' output."""
    prompts = random_prompts([150, 120, 90, 60], four_layer_model.vocab_size, seed=5)
    expected = [hf_greedy(four_layer_model.hf_model, p, 6) for p in prompts]
    transfer = KVTransferConfig(stage_inbox_slots=8)
    with running_deployment(four_layer_model, 2, 1, _router(32), transfer=transfer) as deployment:
        client = Client(deployment.address)
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(client.generate, prompt_token_ids=p, max_tokens=6, temperature=0.0, ignore_eos=True) for p in prompts]
            streams = [f.result(timeout=120) for f in futures]
        assert [s.token_ids for s in streams] == expected
        first = ray.get(deployment.pools.handles[_stage_workers(streams[0])[0]].status.remote())
        second = ray.get(deployment.pools.handles[_stage_workers(streams[0])[1]].status.remote())
        handed_on = [(w.num_stage_chunks_over_nixl, w.num_stage_chunks_over_ray) for w in (first, second)]
        assert sum(n for n, _ in handed_on) > 0 and sum(r for _, r in handed_on) > 0, handed_on
        sampled = [
            client.generate(prompt_token_ids=prompts[0] + [i], max_tokens=10, temperature=0.9, seed=1234, ignore_eos=True).token_ids
            for i in (1, 1)
        ]
        assert sampled[0] == sampled[1] and len(sampled[0]) == 10
        assert all(w.num_kv_blocks_used == 0 for w in client.wait_until_idle())
        client.close()


def test_a_stage_killed_mid_prompt_loses_nothing(ray_cluster, four_layer_model):
    """The second stage dies while a long prompt flows through the pipeline: every stage is
    stopped, the prompt is prefilled again (by the survivors), the output is transformers'."""
    prompt = random_prompts([600], four_layer_model.vocab_size, seed=17)[0]
    expected = hf_greedy(four_layer_model.hf_model, prompt, 6)
    # Small chunks, and a pause after each step, keep the prompt in the pipeline long enough.
    with running_deployment(four_layer_model, 3, 1, _router(8, max_pipeline_stages=2)) as deployment:
        for handle in deployment.pools.handles.values():
            ray.get(handle.set_step_delay.remote(0.02))
        client = Client(deployment.address)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(client.generate, prompt_token_ids=prompt, max_tokens=6, temperature=0.0, ignore_eos=True)
            records = deployment.router.pool.workers
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and sum(1 for r in records.values() if r.num_assigned_prompt_tokens > 0 and r.role.value == "prefill") < 2:
                time.sleep(0.005)
            stages = sorted(r.worker_id for r in records.values() if r.role.value == "prefill" and r.num_assigned_prompt_tokens > 0)
            assert len(stages) == 2, "a two-stage pipeline was running"
            time.sleep(0.3)  # some chunks through both stages
            victim = stages[1]
            ray.kill(deployment.pools.handles[victim], no_restart=True)
            stream = future.result(timeout=180)
        assert stream.token_ids == expected
        assert victim not in _stage_workers(stream)
        survivors = [w for w in client.wait_until_idle(timeout_s=60) if w.worker_id != victim]
        assert all(w.num_kv_blocks_used == 0 for w in survivors)
        client.close()


def test_a_stage_that_dies_after_the_decode_actor_took_the_prompt_changes_nothing(ray_cluster, four_layer_model):
    """Every stage's writes landed and the decode actor decodes, but a stage dies before its
    answer: the request was placed again (the prompt prefilled anew, counted against its retries
    and worker deaths, a healthy stream ended UNAVAILABLE or refused as poison at the limits)."""
    prompt = random_prompts([200], four_layer_model.vocab_size, seed=23)[0]
    expected = hf_greedy(four_layer_model.hf_model, prompt, 24)
    with running_deployment(four_layer_model, 2, 1, _router(32, max_pipeline_stages=2)) as deployment:
        for worker_id in ("prefill-0", "prefill-1"):
            ray.get(deployment.handles[worker_id].set_answer_delay.remote(60.0))
        ray.get(deployment.handles["decode-0"].set_step_delay.remote(0.1))  # still streaming when the stage dies
        client = Client(deployment.address)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(client.generate, prompt_token_ids=prompt, max_tokens=24, temperature=0.0, ignore_eos=True)
            deadline = time.monotonic() + 60
            while True:  # every write landed: the decode actor has the prompt
                active = list(deployment.router.dispatcher.active.values())
                if active and active[0].stages and ray.get(deployment.handles["decode-0"].is_admitted.remote(active[0].work.req_id)):
                    break
                assert time.monotonic() < deadline, "the request never reached the decode actor"
                time.sleep(0.05)
            victim = active[0].stages[1].worker_id
            deployment.kill_worker(victim)
            stream = future.result(timeout=120)
        assert stream.token_ids == expected
        assert victim in _stage_workers(stream), "not placed again"
        client.close()


@pytest.mark.parametrize("decode_stage", [False, True])
def test_quantized_stages_write_their_layers_and_scales(ray_cluster, four_layer_model, decode_stage):
    """int8 cache: each stage moves its layers' elements and scales; the decode actor carries on
    exactly as one engine with the same chunking does, and the stages' bytes add up to the blocks
    (a decode actor computing the last stage quantizes its own layers into the reservation)."""
    prompts = random_prompts([45, 130], four_layer_model.vocab_size, seed=23)
    config = engine_config(kv_cache_dtype="int8")
    local = LLMEngine(four_layer_model.path, engine_config(kv_cache_dtype="int8"))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = [local.generate([p], params)[0].token_ids for p in prompts]
    block_bytes, block_size = local.kv_cache.bytes_per_block, local.kv_cache.block_size
    router = _router(32, pipeline_decode_stage=PipelineMode.ALWAYS if decode_stage else PipelineMode.OFF)
    num_prefill = 1 if decode_stage else 2
    with running_deployment(four_layer_model, num_prefill, 1, router, prefill_engine=config, decode_engine=config) as deployment:
        client = Client(deployment.address)
        for prompt, want in zip(prompts, expected):
            stream = client.generate(prompt_token_ids=prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
            assert stream.token_ids == want
            assert len(_stage_workers(stream)) == 2
            # Two stages of two layers each: with the decode actor as the second, half the bytes move.
            moved = -(-len(prompt) // block_size) * block_bytes
            assert stream.last.timing.kv_bytes_transferred == (moved // 2 if decode_stage else moved)
        assert all(w.num_kv_blocks_used == 0 for w in client.wait_until_idle())
        client.close()


def test_stages_that_are_tensor_parallel_groups(ray_cluster, four_layer_model):
    prompts = random_prompts([70, 150], four_layer_model.vocab_size, seed=29)
    expected = [hf_greedy(four_layer_model.hf_model, p, 6) for p in prompts]
    prefill = engine_config(tensor_parallel_size=2)
    with running_deployment(four_layer_model, 2, 1, _router(32), prefill_engine=prefill) as deployment:
        client = Client(deployment.address)
        for prompt, want in zip(prompts, expected):
            stream = client.generate(prompt_token_ids=prompt, max_tokens=6, temperature=0.0, ignore_eos=True)
            assert stream.token_ids == want
            assert len(_stage_workers(stream)) == 2
        assert all(w.num_kv_blocks_used == 0 for w in client.wait_until_idle())
        client.close()


def test_a_pipelined_prompt_cancelled_mid_prefill_leaves_nothing_behind(shared_workers, four_layer_model):
    """The client cancels while the prompt is in both stages: every stage stops and quiesces, the
    decode actor frees its reservation, and the next prompt through the same actors is exact."""
    prompt, after = random_prompts([600, 90], four_layer_model.vocab_size, seed=31)
    expected = hf_greedy(four_layer_model.hf_model, after, 6)
    with following_router(shared_workers, _router(16, max_pipeline_stages=2)) as deployment:
        for handle in deployment.pools.handles.values():
            ray.get(handle.set_step_delay.remote(0.03))  # 38 chunks of 16 per stage: over 1 s, the cancel comes at 0.4 s
        client = Client(deployment.address)
        call = client.stub.Generate(make_request(prompt_token_ids=prompt, max_tokens=20, temperature=0.0, ignore_eos=True))
        threading.Timer(0.4, call.cancel).start()
        with pytest.raises(grpc.RpcError) as info:
            for _ in call:
                pass
        assert info.value.code() == grpc.StatusCode.CANCELLED
        assert all(w.num_kv_blocks_used == 0 for w in client.wait_until_idle())
        for handle in deployment.pools.handles.values():
            ray.get(handle.set_step_delay.remote(0.0))
        stream = client.generate(prompt_token_ids=after, max_tokens=6, temperature=0.0, ignore_eos=True)
        assert stream.token_ids == expected and len(_stage_workers(stream)) == 2
        client.close()


def test_the_decode_actor_killed_while_stages_push_into_it_loses_nothing(ray_cluster, four_layer_model):
    """The decode actor holding the reservation dies while both stages push their layers into it:
    the stages are stopped, the request is placed on the other decode actor and pipelined again,
    its output is transformers', and no stage keeps a block."""
    prompt = random_prompts([600], four_layer_model.vocab_size, seed=41)[0]
    expected = hf_greedy(four_layer_model.hf_model, prompt, 6)
    with running_deployment(four_layer_model, 2, 2, _router(8, routing_policy=RoutingPolicy.ROUND_ROBIN)) as deployment:
        for handle in deployment.pools.handles.values():
            ray.get(handle.set_step_delay.remote(0.02))  # 75 chunks of 8: over 1.5 s in the pipeline
        client = Client(deployment.address)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(client.generate, prompt_token_ids=prompt, max_tokens=6, temperature=0.0, ignore_eos=True)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not any(len(a.stages) == 2 for a in deployment.router.dispatcher.active.values()):
                time.sleep(0.005)
            (active,) = deployment.router.dispatcher.active.values()
            assert len(active.stages) == 2, "a two-stage pipeline was running"
            time.sleep(0.3)  # some chunks' layers landed from both stages
            assert not active.assembler.has_sent_tokens
            holder = active.decode.worker_id
            deployment.kill_worker(holder)
            stream = future.result(timeout=180)
        assert stream.token_ids == expected
        assert stream.last.decode_worker_id != holder and len(_stage_workers(stream)) == 2
        survivors = [w for w in client.wait_until_idle(timeout_s=60) if w.worker_id != holder]
        assert all(w.num_kv_blocks_used == 0 for w in survivors)
        client.close()


@pytest.mark.parametrize("num_prefill,chunk_tokens", [(1, 16), (2, 23)])
def test_the_decode_actor_as_the_last_stage_decodes_what_transformers_does(shared_workers, four_layer_model, num_prefill, chunk_tokens):
    """The decode actor computes the last layers of every chunk straight into its reservation and
    samples the first token itself: exact for one and two prefill stages before it, again with
    every stage's prefix cache holding the prompts (the decode actor's with every layer, so the
    prefill stages hand it only the activations after that), and a seeded sample repeats."""
    prompts = random_prompts([40, 97, 200], four_layer_model.vocab_size, seed=10 + num_prefill)
    longer = prompts[2] + random_prompts([50], four_layer_model.vocab_size, seed=3)[0]
    expected = [hf_greedy(four_layer_model.hf_model, p, 8) for p in [*prompts, longer]]
    router = _router(chunk_tokens, pipeline_decode_stage=PipelineMode.ALWAYS, max_pipeline_stages=num_prefill + 1)
    with following_router(shared_workers, router) as deployment:
        client = Client(deployment.address)
        for prompt, want in zip(prompts, expected):
            stream = client.generate(prompt_token_ids=prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
            assert stream.token_ids == want
            assert _stage_workers(stream) == [f"prefill-{i}" for i in range(num_prefill)] + ["decode-0"]
        # The last prefill stage wrote its activations into the decode actor's inbox over NIXL.
        last = ray.get(deployment.pools.handles[f"prefill-{num_prefill - 1}"].status.remote())
        assert last.num_stage_chunks_over_nixl > last.num_stage_chunks_over_ray, last
        for prompt, want in zip([*prompts, longer], expected):
            stream = client.generate(prompt_token_ids=prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
            assert stream.token_ids == want
            assert stream.last.timing.prompt_tokens_computed < len(prompt)
        sampled = [
            client.generate(prompt_token_ids=prompts[1] + [7], max_tokens=10, temperature=0.9, seed=99, ignore_eos=True).token_ids
            for _ in range(2)
        ]
        assert sampled[0] == sampled[1] and len(sampled[0]) == 10
        assert all(w.num_kv_blocks_used == 0 for w in client.wait_until_idle())
        client.close()


def test_a_prefill_stage_killed_before_the_decode_stage_loses_nothing(ray_cluster, four_layer_model):
    """The prefill stage feeding the decode actor's stage dies mid-prompt: the decode actor drops
    the half-computed reservation, the prompt is pipelined again through the other prefill actor,
    and the output is transformers'."""
    prompt = random_prompts([600], four_layer_model.vocab_size, seed=43)[0]
    expected = hf_greedy(four_layer_model.hf_model, prompt, 6)
    router = _router(8, pipeline_decode_stage=PipelineMode.ALWAYS, max_pipeline_stages=2)
    with running_deployment(four_layer_model, 2, 1, router) as deployment:
        for handle in deployment.pools.handles.values():
            ray.get(handle.set_step_delay.remote(0.02))
        client = Client(deployment.address)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(client.generate, prompt_token_ids=prompt, max_tokens=6, temperature=0.0, ignore_eos=True)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not any(a.stages for a in deployment.router.dispatcher.active.values()):
                time.sleep(0.005)
            (active,) = deployment.router.dispatcher.active.values()
            (victim,) = [w.worker_id for w in active.stages]
            time.sleep(0.3)  # some chunks through both stages
            ray.kill(deployment.pools.handles[victim], no_restart=True)
            stream = future.result(timeout=180)
        assert stream.token_ids == expected
        assert victim not in _stage_workers(stream) and _stage_workers(stream)[-1] == "decode-0"
        survivors = [w for w in client.wait_until_idle(timeout_s=60) if w.worker_id != victim]
        assert all(w.num_kv_blocks_used == 0 for w in survivors)
        client.close()
