"""The OpenAI Responses API as the official ``openai`` client sees it, against a live deployment
(1 prefill + 2 decode actors, KV-aware routing): short inputs are prefilled on a decode actor,
long ones on the prefill actor. References: the same conversation through chat completions, and
transformers' ``apply_chat_template`` + ``generate``."""

from __future__ import annotations

import dataclasses
import json
import time

import jsonschema
import openai
import pytest
import ray

from router.config import RouterConfig
from router.openai_api.server import OpenAIServer
from tests.checkpoints import hf_greedy
from tests.e2e.test_openai_api import FORECAST, _chat_ids, _http
from tests.e2e.test_openai_api import chat_model as chat_model  # noqa: F401  (module fixture)
from tests.e2e.test_openai_api import hf_tokenizer as hf_tokenizer  # noqa: F401  (module fixture)
from router.responses_api.board import SharedBoard, start_shared_board
from tests.serving import Client, HostedRouter, following_router, running_deployment

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
TOOL = {"type": "function", "name": "get_forecast", "description": FORECAST["function"]["description"], "parameters": FORECAST["function"]["parameters"]}


@pytest.fixture(scope="module")
def deployment(ray_cluster, chat_model, tmp_path_factory):  # noqa: F811
    store = tmp_path_factory.mktemp("responses") / "store.jsonl"
    # Durable workers: routers of their own follow them (the shared-board test).
    config = RouterConfig(http_port=0, responses_store_path=store)
    with running_deployment(chat_model, 1, 2, config, name="responses-api", durable_workers=True) as running:
        yield running


def _chat_text(client, messages, max_tokens):
    return client.chat.completions.create(model="tiny-chat", messages=messages, max_completion_tokens=max_tokens, **GREEDY).choices[0].message.content


@pytest.mark.parametrize("repeat", [1, 12])  # 12: prefilled on the prefill actor
def test_a_response_equals_the_chat_completion_and_transformers_whole_and_streamed(client, chat_model, hf_tokenizer, repeat):  # noqa: F811
    question = "Name a prime number, café! " * repeat
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": question}]
    ids = _chat_ids(hf_tokenizer, messages)
    want = hf_tokenizer.decode(hf_greedy(chat_model.hf_model, ids, 12), skip_special_tokens=True)
    assert _chat_text(client, messages, 12) == want

    response = client.responses.create(model="tiny-chat", instructions="You are terse.", input=question, max_output_tokens=12, **GREEDY)
    assert response.object == "response" and response.model == "tiny-chat" and response.output_text == want
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == len(ids) and response.usage.output_tokens == 12
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"  # cut off by max_output_tokens, as OpenAI marks it

    items = [{"role": "user", "content": [{"type": "input_text", "text": question}]}]
    events = []
    with client.responses.stream(model="tiny-chat", instructions="You are terse.", input=items, max_output_tokens=12, **GREEDY) as stream:
        for event in stream:
            events.append(event.type)
        final = stream.get_final_response()
    assert final.output_text == want and final.usage.output_tokens == 12
    assert events[:2] == ["response.created", "response.in_progress"] and events[-1] == "response.completed"
    assert events[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert events[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def test_a_follow_up_turn_continues_the_stored_conversation_from_the_prefix_cache(client, deployment):
    first_input = "Tell me about the weather in Oslo, and keep it short please. " * 3
    first = client.responses.create(model="tiny-chat", input=first_input, max_output_tokens=8, **GREEDY)
    follow_up = client.responses.create(model="tiny-chat", previous_response_id=first.id, input="And tomorrow?", max_output_tokens=8, **GREEDY)
    messages = [{"role": "user", "content": first_input}, {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And tomorrow?"}]
    assert follow_up.output_text == _chat_text(client, messages, 8)
    assert follow_up.previous_response_id == first.id
    # The follow-up's prompt starts with the first turn's: routed to the actor holding it.
    assert follow_up.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 16 * 16 > 0

    fetched = client.responses.retrieve(first.id)
    assert fetched.id == first.id and fetched.output_text == first.output_text
    deleted = client.responses.delete(first.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    # OpenAI's 400 previous_response_not_found: its clients send the whole conversation on that code.
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model="tiny-chat", previous_response_id=first.id, input="again", max_output_tokens=4)
    assert (raised.value.body["param"], raised.value.body["code"]) == ("previous_response_id", "previous_response_not_found")
    # A response with store: false is not kept.
    unstored = client.responses.create(model="tiny-chat", input="hi", store=False, max_output_tokens=4, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_cache_salt_shares_the_prefix_cache_only_with_the_same_salt(client):
    """vLLM's cache_salt on /v1/responses: a repeated input is found in the prefix cache only
    under the salt that put it there."""
    question = "Salted tenants keep their prompts apart, said the ledger of Bergen. " * 3

    def cached(salt: str) -> tuple[int, str]:
        response = client.responses.create(model="tiny-chat", input=question, max_output_tokens=3, temperature=0.0, extra_body={"cache_salt": salt, "ignore_eos": True})
        return response.usage.input_tokens_details.cached_tokens, response.output_text

    first = cached("tenant-a")
    assert first[0] == 0
    assert cached("tenant-b") == (0, first[1])
    again = cached("tenant-a")
    assert again[0] > 0 and again[1] == first[1]
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        cached("")


def test_stored_responses_survive_a_restart_of_the_http_front_end(client, deployment):
    first = client.responses.create(model="tiny-chat", input="Remember the number seven.", max_output_tokens=6, **GREEDY)

    async def restart():
        old = deployment.front_ends.http
        await old.stop()
        new = OpenAIServer(deployment.router, "127.0.0.1", old.port, old.model_names, model_aliases=old.model_aliases)
        await new.start()
        deployment.front_ends.http = new

    deployment._loop.run(restart())
    fetched = client.responses.retrieve(first.id)
    assert fetched.output_text == first.output_text
    follow_up = client.responses.create(model="tiny-chat", previous_response_id=first.id, input="Which number?", max_output_tokens=6, **GREEDY)
    messages = [{"role": "user", "content": "Remember the number seven."}, {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "Which number?"}]
    assert follow_up.output_text == _chat_text(client, messages, 6)


def test_function_calls_their_outputs_and_a_json_schema_answer(client):
    schema = TOOL["parameters"]
    for question in ("Weather?", "Plan a trip and check the weather first. " * 6):
        response = client.responses.create(
            model="tiny-chat", input=question, tools=[TOOL], tool_choice={"type": "function", "name": "get_forecast"},
            max_output_tokens=120, temperature=1.0, extra_body={"seed": 3},
        )
        (call,) = [item for item in response.output if item.type == "function_call"]
        assert call.name == "get_forecast" and call.call_id.startswith("call_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), schema)
    # The call and its output go back as input items; the chat equivalent renders the same prompt.
    follow_up = client.responses.create(
        model="tiny-chat", previous_response_id=response.id, input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[TOOL], tool_choice="none", max_output_tokens=6, **GREEDY,
    )
    messages = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    chat = openai.OpenAI(base_url=str(client.base_url), api_key="unused", max_retries=0)
    want = chat.chat.completions.create(model="tiny-chat", messages=messages, tools=[FORECAST], tool_choice="none", max_completion_tokens=6, **GREEDY)
    assert follow_up.output_text == want.choices[0].message.content
    assert follow_up.usage.input_tokens == want.usage.prompt_tokens

    streamed_calls = []
    with client.responses.stream(
        model="tiny-chat", input="Weather?", tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
        max_output_tokens=120, temperature=1.0, extra_body={"seed": 4},
    ) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.done":
                streamed_calls.append(event.arguments)
        final = stream.get_final_response()
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert streamed_calls == [call.arguments]
    jsonschema.validate(json.loads(call.arguments), schema)

    answer = client.responses.create(
        model="tiny-chat", input="Weather?", max_output_tokens=120, temperature=1.0, extra_body={"seed": 5},
        text={"format": {"type": "json_schema", "name": "forecast", "schema": schema, "strict": True}},
    )
    assert answer.status == "completed"
    jsonschema.validate(json.loads(answer.output_text), schema)


def test_a_background_response_is_polled_and_cancelled_and_frees_its_blocks(client, deployment):
    grpc_client = Client(deployment.address)
    decodes = [h for name, h in deployment.handles.items() if name.startswith("decode")]
    ray.get([d.set_step_delay.remote(0.05) for d in decodes])
    try:
        started = client.responses.create(model="tiny-chat", input="Count.", background=True, max_output_tokens=1500, **GREEDY)
        assert started.status in ("queued", "in_progress") and started.background
        deadline = time.monotonic() + 10
        while client.responses.retrieve(started.id).usage is None and not client.responses.retrieve(started.id).output and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.responses.retrieve(started.id).status == "in_progress"
        cancelled = client.responses.cancel(started.id)
        assert cancelled.status == "cancelled"
        assert client.responses.retrieve(started.id).status == "cancelled"
        workers = grpc_client.wait_until_idle(timeout_s=15)
        assert all(w.num_kv_blocks_used == 0 for w in workers)
        assert not deployment.router.dispatcher.active
        # Finished in the background: fetched whole.
        done = client.responses.create(model="tiny-chat", input="hi", background=True, max_output_tokens=3, **GREEDY)
        deadline = time.monotonic() + 20
        while client.responses.retrieve(done.id).status in ("queued", "in_progress") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.responses.retrieve(done.id).usage.output_tokens == 3
        with pytest.raises(openai.BadRequestError):
            client.responses.cancel(client.responses.create(model="tiny-chat", input="hi", max_output_tokens=2, **GREEDY).id)
    finally:
        ray.get([d.set_step_delay.remote(0.0) for d in decodes])
        grpc_client.close()


def test_routers_sharing_a_board_answer_for_each_others_responses(client, deployment):
    """Two routers over the same workers with one board actor (as a deployment's replicas share
    it): a response created through one is fetched, continued and deleted through the other, and
    a background response running on one is seen and cancelled through the other."""
    board = start_shared_board("responses-api-test", RouterConfig(), detached=False)
    decodes = [h for name, h in deployment.handles.items() if name.startswith("decode")]
    try:
        with following_router(deployment, RouterConfig(http_port=0), SharedBoard(board)) as one, \
                following_router(deployment, RouterConfig(http_port=0), SharedBoard(board)) as other:
            first_client, other_client = (openai.OpenAI(base_url=f"http://127.0.0.1:{r.http_port}/v1", api_key="none", max_retries=0) for r in (one, other))
            first = first_client.responses.create(model="tiny-chat", input="Remember the number seven.", max_output_tokens=6, **GREEDY)
            assert other_client.responses.retrieve(first.id).output_text == first.output_text
            follow_up = other_client.responses.create(model="tiny-chat", previous_response_id=first.id, input="Which number?", max_output_tokens=6, **GREEDY)
            messages = [{"role": "user", "content": "Remember the number seven."}, {"role": "assistant", "content": first.output_text},
                        {"role": "user", "content": "Which number?"}]
            assert follow_up.output_text == _chat_text(client, messages, 6)

            ray.get([d.set_step_delay.remote(0.05) for d in decodes])
            # A streamed, stored answer is on the board while it runs (it was a 404 until its
            # end): in progress through the other router, not yet a turn to follow up on; and a
            # DELETE while it runs stays deleted once it ends.
            for delete_midway in (False, True):
                with first_client.responses.stream(model="tiny-chat", input="Count.", max_output_tokens=30, **GREEDY) as stream:
                    streamed_id = next(event for event in stream if event.type == "response.created").response.id
                    assert other_client.responses.retrieve(streamed_id).status == "in_progress"
                    if delete_midway:
                        other_client.responses.delete(streamed_id)
                    else:
                        with pytest.raises(openai.BadRequestError, match="still in_progress"):
                            other_client.responses.create(model="tiny-chat", previous_response_id=streamed_id, input="And?", max_output_tokens=2)
                    final = stream.get_final_response()
                assert final.status == "incomplete" and final.usage.output_tokens == 30
                if delete_midway:
                    with pytest.raises(openai.NotFoundError):
                        other_client.responses.retrieve(streamed_id)
                else:
                    assert other_client.responses.retrieve(streamed_id).output_text == final.output_text
            started = first_client.responses.create(model="tiny-chat", input="Count.", background=True, max_output_tokens=1500, **GREEDY)
            deadline = time.monotonic() + 10
            while other_client.responses.retrieve(started.id).status == "queued" and time.monotonic() < deadline:
                time.sleep(0.1)
            assert other_client.responses.retrieve(started.id).status == "in_progress"
            cancelled = other_client.responses.cancel(started.id)
            assert cancelled.status == "cancelled" and first_client.responses.retrieve(started.id).status == "cancelled"
            # The running router ended it and releases it: its final state is put before its
            # session closes (a cancel arriving during the close must not be lost), so the
            # asker can see "cancelled" a moment before the request is gone.
            deadline = time.monotonic() + 10
            while one.router.dispatcher.active:
                assert time.monotonic() < deadline, "the running router did not release the cancelled request"
                time.sleep(0.05)

            other_client.responses.delete(first.id)
            with pytest.raises(openai.NotFoundError):
                first_client.responses.retrieve(first.id)
            assert all(w.num_kv_blocks_used == 0 for w in Client(deployment.address).wait_until_idle(timeout_s=15))
    finally:
        ray.get([d.set_step_delay.remote(0.0) for d in decodes])
        ray.kill(board, no_restart=True)


def test_a_board_actor_that_dies_is_restarted_with_what_its_file_kept(ray_cluster, tmp_path):
    """The routers' shared board is a process that can die: Ray restarts it, it reads its file
    back (stored responses, and what a router left in progress for its successor), and a
    router's long poll for a cancel, in flight when it died, is served by the new one."""
    import asyncio
    import os
    import signal

    from router.responses_api.store import StoredResponse

    handle = start_shared_board("board-death-test", RouterConfig(responses_store_path=tmp_path / "board.jsonl"), detached=False)
    board = SharedBoard(handle)

    async def scenario():
        await board.put("resp_done", StoredResponse({"id": "resp_done", "status": "completed"}, [{"role": "user", "content": "hi"}]))
        await board.put("resp_bg", StoredResponse({"id": "resp_bg", "status": "in_progress"}, owner="router-1", request={"input": "x"}))
        polling = asyncio.ensure_future(board.wait_for_cancel("resp_bg", 60))
        pid = ray.get(handle.__ray_call__.remote(lambda board: os.getpid()))
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:  # the restarted actor answers
            try:
                done = await board.get("resp_done")
                break
            except ray.exceptions.RayActorError:
                assert time.monotonic() < deadline, "the board was not restarted"
                await asyncio.sleep(0.2)
        assert done.conversation == [{"role": "user", "content": "hi"}]
        assert [rid for rid, _ in await board.in_progress_of("router-1")] == ["resp_bg"]
        await board.request_cancel("resp_bg")
        assert await asyncio.wait_for(polling, 30), "the running router hears the cancel through the new board"

    try:
        asyncio.run(scenario())
    finally:
        ray.kill(handle, no_restart=True)


@pytest.mark.parametrize("first_router", [0, 2], ids=["same-name", "replica-no-longer-run"])
def test_a_background_response_whose_router_dies_is_run_again_by_the_one_that_takes_its_place(client, deployment, tmp_path, first_router):
    """The router running a background response dies (its loop stops where it stands); a router
    started over the same store file in its place runs the response again, to the answer an
    uninterrupted run gives, and the dead router's request on the workers is dropped. The dead
    one is the managing router, or a replica the deployment no longer runs (it restarted with
    fewer ``router.replicas``): then the managing router takes its place."""
    config = RouterConfig(http_port=0, responses_store_path=tmp_path / "store.jsonl", router_lease_s=2.0)
    want = _chat_text(client, [{"role": "user", "content": "Count slowly."}], 40)
    decodes = [h for name, h in deployment.handles.items() if name.startswith("decode")]
    first = HostedRouter(dataclasses.replace(deployment.spec, router=config), replica_index=first_router)
    try:
        first.start_pools(manage=False)
        ray.get([d.set_step_delay.remote(0.05) for d in decodes])  # 40 tokens: 2 s or more
        first_client = openai.OpenAI(base_url=f"http://127.0.0.1:{first.http_port}/v1", api_key="none", max_retries=0)
        started = first_client.responses.create(model="tiny-chat", input="Count slowly.", background=True, max_output_tokens=40, **GREEDY)
        deadline = time.monotonic() + 10
        while first_client.responses.retrieve(started.id).status == "queued" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first_client.responses.retrieve(started.id).status == "in_progress"
    finally:
        first.crash()
    ray.get([d.set_step_delay.remote(0.0) for d in decodes])
    with following_router(deployment, config) as second:
        second_client = openai.OpenAI(base_url=f"http://127.0.0.1:{second.http_port}/v1", api_key="none", max_retries=0)
        deadline = time.monotonic() + 60
        while (done := second_client.responses.retrieve(started.id)).status in ("queued", "in_progress"):
            assert time.monotonic() < deadline, "the response was not run again"
            time.sleep(0.1)
        assert done.status == "incomplete" and done.output_text == want and done.usage.output_tokens == 40
        assert done.created_at == started.created_at
        assert all(w.num_kv_blocks_used == 0 for w in Client(deployment.address).wait_until_idle(timeout_s=30))


def test_a_disconnect_mid_stream_frees_every_block(client, deployment):
    grpc_client = Client(deployment.address)
    decodes = [h for name, h in deployment.handles.items() if name.startswith("decode")]
    ray.get([d.set_step_delay.remote(0.05) for d in decodes])
    try:
        with client.responses.stream(model="tiny-chat", input="Count.", max_output_tokens=1500, **GREEDY) as stream:
            for _, event in zip(range(6), stream):
                streamed_id = event.response.id if event.type == "response.created" else streamed_id
        workers = grpc_client.wait_until_idle(timeout_s=15)
        assert all(w.num_kv_blocks_used == 0 for w in workers)
        assert not deployment.router.dispatcher.active
        # Stored, it ends as cancelled with what was written, not "in_progress" for good.
        deadline = time.monotonic() + 10
        while (left := client.responses.retrieve(streamed_id)).status == "in_progress":
            assert time.monotonic() < deadline, "the stream the client left stays in progress"
            time.sleep(0.05)
        assert left.status == "cancelled" and left.output_text
    finally:
        ray.get([d.set_step_delay.remote(0.0) for d in decodes])
        grpc_client.close()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"input": [{"type": "reasoning", "content": [{"type": "summary_text", "text": "x"}]}, {"role": "user", "content": "hi"}]}, "input[0].content[0].type"),
        ({"input": [{"type": "file_search_call", "id": "x"}]}, "input[0].type"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"input": "hi", "reasoning": {"effort": "max"}}, "reasoning.effort"),
        ({"input": "hi", "reasoning": {"summary": "long"}}, "reasoning.summary"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]}, "input[0].arguments"),
        ({"input": "hi", "bogus": 1}, "bogus"),
        ({"input": "hi", "background": True, "stream": True}, "background"),
        ({"input": [{"role": [[]], "content": "hi"}]}, "input[0].role"),  # an unhashable value, not a 500
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[" * 3000 + "]" * 3000}]}, "input[0].arguments"),
        ({"input": "hi", "seed": 2**63}, "seed"),
    ],
)
def test_bad_requests_get_a_400_naming_the_field(base_url, body, param):
    status, raw, _ = _http(base_url, "/v1/responses", {"model": "tiny-chat", **body})
    assert status == 400 and json.loads(raw)["error"]["param"] == param, raw


OTHER_TEMPLATE = """{{ bos_token }}[{{ persona }}]
{%- for message in messages %}
{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}
{%- endfor %}
{%- if add_generation_prompt %}
assistant:{% endif %}"""


def test_a_configured_chat_template_and_its_default_kwargs_replace_the_models(deployment, chat_model, hf_tokenizer):  # noqa: F811
    """vLLM's --chat-template and --default-chat-template-kwargs: every chat renders with the
    configured template, its variables under the request's own chat_template_kwargs."""
    config = RouterConfig(http_port=0, chat_template=OTHER_TEMPLATE, default_chat_template_kwargs={"persona": "pirate"})
    messages = [{"role": "user", "content": "Where is the treasure?"}]
    with following_router(deployment, config) as router:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key="none", max_retries=0)
        for kwargs, persona in (({}, "pirate"), ({"chat_template_kwargs": {"persona": "robot"}}, "robot")):
            ids = hf_tokenizer.apply_chat_template(messages, chat_template=OTHER_TEMPLATE, add_generation_prompt=True, tokenize=True, persona=persona)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            want = hf_tokenizer.decode(hf_greedy(chat_model.hf_model, ids, 8), skip_special_tokens=True)
            chat = client.chat.completions.create(
                model="tiny-chat", messages=messages, max_completion_tokens=8, temperature=0.0, extra_body={"ignore_eos": True, **kwargs},
            )
            assert chat.usage.prompt_tokens == len(ids) and chat.choices[0].message.content == want


def test_input_items_are_listed_a_page_at_a_time_and_input_tokens_counted(client):
    """GET /v1/responses/{id}/input_items and POST /v1/responses/input_tokens, as the openai
    client calls them (a 404 and a 405 before): the items with ids, newest first by default, a
    page at a time after an id; the count is the prompt's as a call renders it."""
    items = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}, {"role": "user", "content": "three"}]
    created = client.responses.create(model="tiny-chat", instructions="Be terse.", input=items, max_output_tokens=2, **GREEDY)
    listed = list(client.responses.input_items.list(created.id, order="asc", limit=1))  # the client follows the pages
    assert [(item.role, item.content[0].text) for item in listed] == [("user", "one"), ("assistant", "two"), ("user", "three")]
    assert len({item.id for item in listed}) == 3
    newest = client.responses.input_items.list(created.id)
    assert [item.content[0].text for item in newest.data] == ["three", "two", "one"] and not newest.has_more
    counted = client.responses.input_tokens.count(model="tiny-chat", instructions="Be terse.", input=items)
    assert counted.input_tokens == created.usage.input_tokens
    # A follow-up turn lists every item it was generated from: the earlier turn's input and
    # output first (its own input alone, before), as OpenAI lists a chain.
    follow_up = client.responses.create(model="tiny-chat", previous_response_id=created.id, input="four", max_output_tokens=2, **GREEDY)
    chain = list(client.responses.input_items.list(follow_up.id, order="asc"))
    assert [item.id for item in chain] == [*(item.id for item in listed), created.output[0].id, chain[-1].id]
    assert chain[3].role == "assistant" and chain[3].content[0].text == created.output_text and chain[-1].content[0].text == "four"
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_none")
