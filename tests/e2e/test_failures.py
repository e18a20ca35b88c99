"""Faults a user meets: workers dying mid-request, extreme request values, cancels at any moment."""

from __future__ import annotations

import concurrent.futures
import re
import threading
import time

import grpc
import pytest
import ray
import torch

from router.api.pdserve.v1 import generation_pb2 as pb
from router.config import Disaggregation, RouterConfig
from engine.stats import WorkerState
from router.pipeline import PipelineMode
from router.pool import Role, RoutingPolicy
from tests.checkpoints import hf_greedy, random_prompts
from tests.serving import Client, engine_config, following_router, kill_during_greedy_burst, make_request, running_deployment


@pytest.fixture(scope="module")
def untouched_workers(ray_cluster, e2e_model):
    """One prefill and one decode actor, durable, for the tests here that kill no worker: each
    routes through a router of its own configuration that follows them (``following_router``)."""
    router = RouterConfig(disaggregation=Disaggregation.ALWAYS)
    with running_deployment(e2e_model, 1, 1, router, name="failures-shared", durable_workers=True) as deployment:
        yield deployment


def _slow_down(deployment, worker_id: str, seconds: float = 0.02) -> None:
    """The worker about to be killed sleeps after each step (20 ms: 2 s for 100 tokens or for a
    1,600-token prompt in 32-token chunks), so that its requests are still in progress when it
    dies, as they would be with hundreds more tokens or tiny chunks, at a fraction of the CPU."""
    ray.get(deployment.handles[worker_id].set_step_delay.remote(seconds))


def test_killing_a_prefill_actor_during_a_burst_loses_no_request(ray_cluster, e2e_model):
    prompts = random_prompts([700, 650, 600, 550, 500, 450, 400, 350], e2e_model.vocab_size, seed=21)
    expected = [hf_greedy(e2e_model.hf_model, p, 6) for p in prompts]
    router = RouterConfig(disaggregation=Disaggregation.ALWAYS)
    with running_deployment(e2e_model, 2, 1, router) as deployment:
        client = Client(deployment.address)
        _slow_down(deployment, "prefill-0", 0.05)  # its prompts are in prefill when the kill lands
        streams, in_progress = kill_during_greedy_burst(client, deployment, prompts, lambda: deployment.kill_worker("prefill-0"), timeout_s=120)
        assert in_progress >= 1000, "the killed prefill actor had prompts in progress"
        for stream, want in zip(streams, expected):
            assert stream.token_ids == want
        assert all(s.last.prefill_worker_id == "prefill-1" for s in streams), "retried on the survivor"
        survivors = [w for w in client.wait_until_idle() if w.worker_id != "prefill-0"]
        assert all(w.num_kv_blocks_used == 0 for w in survivors)
        client.close()


def test_a_scored_prompt_whose_prefill_actor_died_after_its_last_write_is_prefilled_again(ray_cluster, e2e_model):
    """The prompt's KV all landed and the decode actor decodes, but the prefill actor dies before
    it answers, and its answer carried the prompt's log-probabilities: the request is prefilled
    again on the other actor and the client gets every score and the tokens once (it got
    UNAVAILABLE before)."""
    (prompt,) = random_prompts([60], e2e_model.vocab_size, seed=61)
    with torch.no_grad():
        reference = torch.log_softmax(e2e_model.hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    router = RouterConfig(disaggregation=Disaggregation.ALWAYS)
    with running_deployment(e2e_model, 2, 1, router) as deployment:
        for worker_id in ("prefill-0", "prefill-1"):
            ray.get(deployment.handles[worker_id].set_answer_delay.remote(60.0))
        client = Client(deployment.address)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            job = pool.submit(client.generate, prompt_token_ids=prompt, max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
            deadline = time.monotonic() + 60
            while True:  # its last write landed: the decode actor has it
                active = list(deployment.router.dispatcher.active.values())
                if active and active[0].prefill is not None and ray.get(deployment.handles["decode-0"].is_admitted.remote(active[0].work.req_id)):
                    break
                assert time.monotonic() < deadline, "the request never reached the decode actor"
                time.sleep(0.05)
            holder = active[0].prefill.worker_id
            survivor = "prefill-1" if holder == "prefill-0" else "prefill-0"
            ray.get(deployment.handles[survivor].set_answer_delay.remote(0.0))
            deployment.kill_worker(holder)
            stream = job.result(timeout=120)
        assert stream.token_ids == hf_greedy(e2e_model.hf_model, prompt, 6)
        assert stream.last.prefill_worker_id == survivor
        first, *rest = stream.messages
        assert [e.token_id for e in first.prompt_logprobs] == prompt[1:] and not any(m.prompt_logprobs for m in rest)
        for position, entry in enumerate(first.prompt_logprobs):
            assert entry.logprob == pytest.approx(reference[position, prompt[position + 1]].item(), abs=1e-3)
        assert all(w.num_kv_blocks_used == 0 for w in client.wait_until_idle() if w.worker_id != holder)
        client.close()


class ParallelStreams:
    """Streams sent at once from threads; each result is a Stream or the RpcError it ended with."""

    def __init__(self, client: Client, requests: list[dict]):
        self.results: dict[int, object] = {}
        self._threads = [threading.Thread(target=self._run, args=(client, i, r)) for i, r in enumerate(requests)]
        for thread in self._threads:
            thread.start()

    def _run(self, client: Client, index: int, request: dict) -> None:
        try:
            self.results[index] = client.generate(timeout=120, **request)
        except grpc.RpcError as exc:
            self.results[index] = exc

    def join(self) -> list:
        for thread in self._threads:
            thread.join(120)
        return [self.results[i] for i in range(len(self._threads))]


def _wait_until_every_stream_sent_tokens(deployment, num_streams: int, at_least: int = 10) -> None:
    active = deployment.router.dispatcher.active
    deadline = time.monotonic() + 30
    while not (len(active) == num_streams and all(a.assembler.num_completion_tokens >= at_least for a in list(active.values()))):
        assert time.monotonic() < deadline, "streams did not start"
        time.sleep(0.005)




def test_a_stream_whose_decode_actor_dies_migrates_with_no_gap_and_no_repeat(ray_cluster, e2e_model):
    """Killed mid-decode, decode-0's streams are re-prefilled (prompt plus the tokens sent) on
    decode-1 through the prefill actor and go on: greedy output equals transformers' for the
    whole run, and a seeded sampled stream equals its own uninterrupted run, a constrained one
    too (its grammar rebuilt from the tokens it had sent)."""
    router = RouterConfig(disaggregation=Disaggregation.ALWAYS, routing_policy=RoutingPolicy.ROUND_ROBIN)
    prompts = random_prompts([40, 60, 80, 100], e2e_model.vocab_size, seed=22)
    num_tokens = 160
    expected = [hf_greedy(e2e_model.hf_model, p, num_tokens) for p in prompts]
    seeded = dict(prompt_token_ids=prompts[0], max_tokens=num_tokens, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    constrained = dict(
        prompt_token_ids=prompts[1], max_tokens=num_tokens, temperature=1.0, seed=5, structured_output=pb.StructuredOutput(regex="[a-z ]{5000}")  # no end in sight
    )
    with running_deployment(e2e_model, 1, 2, router) as deployment:
        client = Client(deployment.address)
        seeded_reference = client.generate(**seeded).token_ids
        constrained_reference = client.generate(**constrained)
        assert re.fullmatch("[a-z ]+", constrained_reference.text) and len(constrained_reference.token_ids) == num_tokens
        requests = [dict(prompt_token_ids=p, max_tokens=num_tokens, temperature=0.0, ignore_eos=True) for p in prompts]
        _slow_down(deployment, "decode-0")
        streams = ParallelStreams(client, [*requests, seeded, constrained])
        _wait_until_every_stream_sent_tokens(deployment, len(requests) + 2)
        on_victim = {a.req_id for a in deployment.router.dispatcher.active.values() if a.decode.worker_id == "decode-0"}
        deployment.kill_worker("decode-0")
        results = streams.join()
        assert not [r for r in results if isinstance(r, grpc.RpcError)], "no stream failed"
        assert on_victim, "round robin put streams on decode-0"
        for stream, want, prompt in zip(results, expected, prompts):
            assert stream.token_ids == want, "no token lost, repeated or changed"
            assert stream.last.finish_reason == pb.FINISH_REASON_LENGTH
            assert stream.last.usage.completion_tokens == num_tokens
            assert stream.last.usage.prompt_tokens == len(prompt)
        assert results[-2].token_ids == seeded_reference
        assert results[-1].token_ids == constrained_reference.token_ids
        migrated = [s for s in results if s.messages[0].request_id in on_victim]
        assert migrated and all(s.last.decode_worker_id == "decode-1" for s in migrated)
        survivors = [w for w in client.wait_until_idle() if w.worker_id != "decode-0"]
        assert all(w.num_kv_blocks_used == 0 for w in survivors)
        client.close()


def test_a_decode_actor_killed_with_a_step_in_flight_loses_no_token(ray_cluster, e2e_model):
    """Decode actors overlapping their steps (async_scheduling): decode-0 dies with a step in
    flight and sampled tokens not yet read; its greedy streams migrate to decode-1 with no gap and
    no repeat, equal to transformers', and the survivor frees every block."""
    router = RouterConfig(disaggregation=Disaggregation.ALWAYS, routing_policy=RoutingPolicy.ROUND_ROBIN)
    prompts = random_prompts([40, 60, 80, 100], e2e_model.vocab_size, seed=31)
    num_tokens = 120
    expected = [hf_greedy(e2e_model.hf_model, p, num_tokens) for p in prompts]
    with running_deployment(e2e_model, 1, 2, router, decode_engine=engine_config(async_scheduling=True)) as deployment:
        client = Client(deployment.address)
        # It sleeps between turns with the last step's tokens sampled and not yet read: the kill
        # lands on a step in flight.
        _slow_down(deployment, "decode-0")
        streams = ParallelStreams(client, [dict(prompt_token_ids=p, max_tokens=num_tokens, temperature=0.0, ignore_eos=True) for p in prompts])
        _wait_until_every_stream_sent_tokens(deployment, len(prompts))
        on_victim = {a.req_id for a in deployment.router.dispatcher.active.values() if a.decode.worker_id == "decode-0"}
        deployment.kill_worker("decode-0")
        results = streams.join()
        assert not [r for r in results if isinstance(r, grpc.RpcError)], "no stream failed"
        assert on_victim, "round robin put streams on decode-0"
        for stream, want in zip(results, expected):
            assert stream.token_ids == want, "no token lost, repeated or changed"
            assert stream.last.usage.completion_tokens == num_tokens
        migrated = [s for s in results if s.messages[0].request_id in on_victim]
        assert migrated and all(s.last.decode_worker_id == "decode-1" for s in migrated)
        survivors = [w for w in client.wait_until_idle() if w.worker_id != "decode-0"]
        assert all(w.num_kv_blocks_used == 0 for w in survivors)
        client.close()


def test_where_migration_is_not_allowed_the_stream_ends_with_an_error_message_and_its_usage(ray_cluster, e2e_model):
    router = RouterConfig(disaggregation=Disaggregation.NEVER, routing_policy=RoutingPolicy.ROUND_ROBIN, max_decode_restarts=0)
    prompts = random_prompts([10, 12, 14, 16], e2e_model.vocab_size, seed=23)
    num_tokens = 200
    with running_deployment(e2e_model, 0, 2, router) as deployment:
        client = Client(deployment.address)
        _slow_down(deployment, "decode-0")
        requests = [dict(prompt_token_ids=p, max_tokens=num_tokens, temperature=0.0, ignore_eos=True) for p in prompts]
        streams = ParallelStreams(client, requests)
        _wait_until_every_stream_sent_tokens(deployment, len(prompts))
        deployment.kill_worker("decode-0")  # every stream is mid-decode
        results = streams.join()
        assert not [r for r in results if isinstance(r, grpc.RpcError)], "every stream ends with a message, not a bare status"
        cut = [s for s in results if s.last.finish_reason == pb.FINISH_REASON_ERROR]
        whole = [s for s in results if s.last.finish_reason == pb.FINISH_REASON_LENGTH]
        assert cut and whole and len(cut) + len(whole) == len(prompts), "round robin put streams on both decode actors"
        for stream in cut:
            assert "decode-0" in stream.last.finish_detail and "restarts" in stream.last.finish_detail
            assert stream.last.usage.completion_tokens == len(stream.token_ids) < num_tokens
            prompt = prompts[results.index(stream)]
            assert stream.token_ids == hf_greedy(e2e_model.hf_model, prompt, len(stream.token_ids))
        for stream in whole:
            assert len(stream.token_ids) == num_tokens and stream.last.decode_worker_id == "decode-1"
        # New requests go to the survivor.
        again = client.generate(prompt_token_ids=prompts[0], max_tokens=4, temperature=0.0, ignore_eos=True)
        assert again.last.decode_worker_id == "decode-1"
        assert again.token_ids == hf_greedy(e2e_model.hf_model, prompts[0], 4)
        client.close()


def test_when_the_only_decode_actor_dies_its_stream_and_new_requests_wait_for_the_replacement(ray_cluster, e2e_model):
    router = RouterConfig(disaggregation=Disaggregation.NEVER)
    prompts = random_prompts([30, 20], e2e_model.vocab_size, seed=24)
    expected = [hf_greedy(e2e_model.hf_model, prompts[0], 150), hf_greedy(e2e_model.hf_model, prompts[1], 8)]
    with running_deployment(e2e_model, 0, 1, router, health_interval_s=0.3) as deployment:
        client = Client(deployment.address)
        _slow_down(deployment, "decode-0")
        streams = ParallelStreams(client, [dict(prompt_token_ids=prompts[0], max_tokens=150, temperature=0.0, ignore_eos=True)])
        _wait_until_every_stream_sent_tokens(deployment, 1)
        deployment.kill_worker("decode-0")
        # Sent while no decode actor is left: it waits for the replacement instead of failing.
        late = client.generate(timeout=120, prompt_token_ids=prompts[1], max_tokens=8, temperature=0.0, ignore_eos=True)
        (stream,) = streams.join()
        assert not isinstance(stream, grpc.RpcError), stream
        assert stream.token_ids == expected[0]
        assert late.token_ids == expected[1]
        assert stream.last.decode_worker_id == late.last.decode_worker_id == "decode-1"
        client.wait_until_idle()
        client.close()


def test_request_that_sent_no_token_is_restarted_on_another_decode_actor(ray_cluster, e2e_model):
    # One actor prefills the prompt chunk by chunk (not a pipeline with an idle decode actor as its last stage).
    router = RouterConfig(disaggregation=Disaggregation.ALWAYS, routing_policy=RoutingPolicy.ROUND_ROBIN, prefill_pipeline=PipelineMode.OFF)
    (prompt,) = random_prompts([1500], e2e_model.vocab_size, seed=23)
    with running_deployment(e2e_model, 1, 2, router) as deployment:
        client = Client(deployment.address)
        _slow_down(deployment, "prefill-0")  # 47 chunks: over a second of prefill
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(client.generate, prompt_token_ids=prompt, max_tokens=5, temperature=0.0, ignore_eos=True)
            prefill = deployment.router.pool.workers["prefill-0"]
            deadline = time.monotonic() + 30
            while prefill.num_assigned_prompt_tokens == 0 and time.monotonic() < deadline:
                time.sleep(0.002)  # wait until the prompt is prefilling: no token has reached the client
            (active,) = deployment.router.dispatcher.active.values()
            assert not active.assembler.has_sent_tokens
            holder = active.decode.worker_id
            deployment.kill_worker(holder)
            stream = future.result(timeout=120)
        assert stream.token_ids == hf_greedy(e2e_model.hf_model, prompt, 5)
        assert stream.last.decode_worker_id != holder
        survivors = [w for w in client.wait_until_idle() if w.worker_id != holder]
        assert all(w.num_kv_blocks_used == 0 for w in survivors)
        client.close()


def test_extreme_sampling_values_crash_no_worker_and_disturb_no_other_request(untouched_workers, e2e_model):
    """temperature 1e-40 and repetition_penalty 1e-40 used to kill the decode actor (and, with a
    long prompt, the prefill actor that samples the first token); retries then carried the request
    from worker to worker. Now each request finishes, and the same workers serve on."""
    router = RouterConfig(disaggregation=Disaggregation.ALWAYS)
    long_prompt, short_prompt = random_prompts([200, 12], e2e_model.vocab_size, seed=31)
    with following_router(untouched_workers, router) as deployment:
        client = Client(deployment.address)
        epochs = {w.worker_id: w.epoch for w in client.status()}
        cases = [
            dict(prompt_token_ids=long_prompt, max_tokens=4, temperature=1e-40),
            dict(prompt_token_ids=long_prompt, max_tokens=4, temperature=1.0, repetition_penalty=1e-40, seed=3),
            dict(prompt_token_ids=short_prompt, max_tokens=4, temperature=0.0),
        ]
        with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
            streams = list(pool.map(lambda case: client.generate(ignore_eos=True, **case), cases))
        assert all(len(s.token_ids) == 4 for s in streams)
        assert streams[0].token_ids == hf_greedy(e2e_model.hf_model, long_prompt, 4), "a vanishing temperature is greedy"
        assert streams[2].token_ids == hf_greedy(e2e_model.hf_model, short_prompt, 4)
        assert {w.worker_id: w.epoch for w in client.wait_until_idle()} == epochs, "no worker died or was replaced"
        client.close()


def test_cancels_at_any_moment_free_their_blocks_at_once_and_free_the_id(untouched_workers, e2e_model):
    """Cancelled just after the decode reservation (or during the reserve call), a request used
    to keep its blocks until the lease ran out, and its id answered "already holds a
    reservation". With a 300 s lease, every block must come back within seconds."""
    router = RouterConfig(disaggregation=Disaggregation.ALWAYS, kv_lease_s=300.0)
    prompts = random_prompts([300] * 6, e2e_model.vocab_size, seed=41)
    with following_router(untouched_workers, router) as deployment:
        client = Client(deployment.address)
        ray.get(deployment.handles["prefill-0"].set_step_delay.remote(0.05))
        calls = []
        for round_index, delay in enumerate([0.0, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2] * 3):
            request = make_request(prompt_token_ids=prompts[round_index % len(prompts)], max_tokens=4, temperature=0.0)
            request.request_id = f"cancelled-{round_index % 4}"  # ids reused across rounds
            call = client.stub.Generate(request, timeout=60)
            time.sleep(delay)
            call.cancel()
            calls.append(call)
        assert all(c.code() is grpc.StatusCode.CANCELLED for c in calls), [(c.code(), c.details()) for c in calls if c.code() is not grpc.StatusCode.CANCELLED]
        ray.get(deployment.handles["prefill-0"].set_step_delay.remote(0.0))
        # The id of a request cancelled a moment ago is taken again at once, and served.
        request = make_request(prompt_token_ids=prompts[0], max_tokens=4, temperature=0.0, ignore_eos=True)
        request.request_id = "cancelled-0"
        tokens = [t for message in client.stub.Generate(request, timeout=60) for t in message.token_ids]
        assert tokens == hf_greedy(e2e_model.hf_model, prompts[0], 4)
        workers = client.wait_until_idle(timeout_s=15)
        assert all(w.num_kv_blocks_used == 0 for w in workers), "no block waits for the 300 s lease"
        client.close()


def test_a_request_present_at_two_worker_deaths_is_refused_not_carried_on(ray_cluster, e2e_model):
    """Poison detection: a request whose prefill actor dies is retried once elsewhere; when that one
    dies too it is refused with a clear error instead of being carried to a third worker."""
    router = RouterConfig(disaggregation=Disaggregation.ALWAYS)
    (prompt,) = random_prompts([600], e2e_model.vocab_size, seed=51)
    with running_deployment(e2e_model, 2, 1, router) as deployment:
        client = Client(deployment.address)
        for worker_id in ("prefill-0", "prefill-1"):  # 19 chunks of 32 tokens take 2 s now
            _slow_down(deployment, worker_id, 0.1)
        outcome: dict[str, object] = {}

        def run():
            try:
                outcome["stream"] = client.generate(timeout=120, prompt_token_ids=prompt, max_tokens=4, ignore_eos=True)
            except grpc.RpcError as exc:
                outcome["error"] = exc

        runner = threading.Thread(target=run)
        runner.start()
        killed: list[str] = []
        deadline = time.monotonic() + 60
        while len(killed) < 2 and time.monotonic() < deadline and runner.is_alive():
            holder = next(
                (w for w in deployment.router.pool.of_role(Role.PREFILL)
                 if w.num_assigned_prompt_tokens > 0 and w.worker_id not in killed and w.state is not WorkerState.DEAD),
                None,
            )
            if holder is None:
                time.sleep(0.01)
                continue
            time.sleep(0.2)  # let it compute a few chunks: it is mid-prefill, not queued
            deployment.kill_worker(holder.worker_id)
            killed.append(holder.worker_id)
        runner.join(120)
        assert len(killed) == 2, "the request sat on two prefill actors in turn"
        error = outcome.get("error")
        assert error is not None, "refused, not served by a third worker"
        assert error.code() is grpc.StatusCode.INTERNAL
        assert "2 workers that died" in error.details() and all(w in error.details() for w in killed)
        # Its reservation on the decode actor ends too. The abort must name the attempt the
        # decode actor holds: the second death had numbered a new one, the abort named that, and
        # the decode actor ignored it, keeping the blocks for good.
        assert all(w.num_kv_blocks_used == 0 for w in client.wait_until_idle() if w.worker_id not in killed)
        client.close()


def test_a_prefill_whose_only_decode_actor_dies_mid_push_is_redirected_to_the_replacement(ray_cluster, e2e_model):
    """One prefill and one decode actor; the decode actor is killed while the prefill actor pushes
    a long prompt's KV into it. The request is not failed (it was: UNAVAILABLE, "posting a write
    to decode-0 failed", from the old attempt's write errors): it waits for the replacement decode
    actor and is prefilled again into it, exactly."""
    # One actor pushes every chunk: not a pipeline with the (idle) decode actor as its last stage,
    # whose few large chunks could finish before the kill.
    router = RouterConfig(disaggregation=Disaggregation.ALWAYS, prefill_pipeline=PipelineMode.OFF)
    (prompt,) = random_prompts([1800], e2e_model.vocab_size, seed=29)
    with running_deployment(e2e_model, 1, 1, router, health_interval_s=0.3) as deployment:
        client = Client(deployment.address)
        _slow_down(deployment, "prefill-0")  # 57 chunks, each pushed: over a second of pushes
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(client.generate, timeout=120, prompt_token_ids=prompt, max_tokens=5, temperature=0.0, ignore_eos=True)
            prefill = deployment.router.pool.workers["prefill-0"]
            deadline = time.monotonic() + 30
            while prefill.num_assigned_prompt_tokens == 0 and time.monotonic() < deadline:
                time.sleep(0.002)
            time.sleep(0.1)  # some chunks pushed into the reservation
            (active,) = deployment.router.dispatcher.active.values()
            assert not active.assembler.has_sent_tokens and active.decode.worker_id == "decode-0"
            deployment.kill_worker("decode-0")
            stream = future.result(timeout=150)
        assert stream.token_ids == hf_greedy(e2e_model.hf_model, prompt, 5)
        assert stream.last.decode_worker_id == "decode-1"
        assert all(w.num_kv_blocks_used == 0 for w in client.wait_until_idle(timeout_s=60))
        client.close()


def test_n_choices_sharing_a_prompt_lose_nothing_when_their_decode_actor_dies(ray_cluster, e2e_model):
    """The choices of one prompt after the first follow it to its decode actor and take the
    prompt from its cache there (router.share_choice_prompts): that actor killed while they
    stream, every choice migrates to the other one and still gives transformers' answer."""
    import openai
    from transformers import AutoTokenizer

    prompt = random_prompts([120], e2e_model.vocab_size, seed=31)[0]
    num_tokens = 120
    want = AutoTokenizer.from_pretrained(e2e_model.path).decode(hf_greedy(e2e_model.hf_model, prompt, num_tokens), skip_special_tokens=True)
    router = RouterConfig(disaggregation=Disaggregation.ALWAYS, http_port=0)
    with running_deployment(e2e_model, 1, 2, router) as deployment:
        for worker_id in ("decode-0", "decode-1"):
            _slow_down(deployment, worker_id)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{deployment.http_port}/v1", api_key="none", max_retries=0)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(client.completions.create, model=e2e_model.path.name, prompt=prompt, n=3, max_tokens=num_tokens,
                                 temperature=0.0, extra_body={"ignore_eos": True})
            _wait_until_every_stream_sent_tokens(deployment, 3)
            placed = {a.decode.worker_id for a in deployment.router.dispatcher.active.values()}
            assert len(placed) == 1, f"the choices share one decode actor: {placed}"
            (victim,) = placed
            deployment.kill_worker(victim)
            completion = future.result(timeout=120)
        assert [choice.text for choice in completion.choices] == [want] * 3
        assert completion.usage.completion_tokens == 3 * num_tokens
        survivors = [w for w in Client(deployment.address).wait_until_idle() if w.worker_id != victim]
        assert all(w.num_kv_blocks_used == 0 for w in survivors)
