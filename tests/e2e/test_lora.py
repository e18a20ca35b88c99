"""LoRA adapters served through a live deployment: the OpenAI API's ``model`` (and gRPC's
``lora_name``) picks an adapter, every prompt is prefilled by a pipeline of the two prefill
actors (each its layers, through the adapter; a scored prompt by one of them) and its KV pushed
over NIXL to the decode actor, and each answer is PEFT's own model's."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
import ray
import torch

from router.api.pdserve.v1 import generation_pb2 as pb
from router.config import Disaggregation, RouterConfig
from router.pipeline import PipelineMode
from tests.checkpoints import build_lora_adapter, hf_greedy, random_prompts
from tests.serving import Client, engine_config, running_deployment

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
MAX_NEW = 8


@pytest.fixture(scope="module")
def adapters(e2e_model, tmp_path_factory):
    """name -> (directory, PEFT model): one on every projection, one on attention only."""
    root = tmp_path_factory.mktemp("lora_adapters")
    return {
        "sql-lora": (root / "sql", build_lora_adapter(e2e_model.hf_model, root / "sql", seed=21)),
        "chat-lora": (root / "chat", build_lora_adapter(e2e_model.hf_model, root / "chat", seed=22, targets=("q_proj", "k_proj", "v_proj", "o_proj"), rank=16)),
    }


@pytest.fixture(scope="module")
def deployment(ray_cluster, e2e_model, adapters):
    served = {name: str(directory) for name, (directory, _) in adapters.items()}
    engine = engine_config(lora_adapters=served)
    router = RouterConfig(
        http_port=0, disaggregation=Disaggregation.ALWAYS, prefill_pipeline=PipelineMode.ALWAYS, pipeline_chunk_tokens=16,
        pipeline_decode_stage=PipelineMode.OFF, allow_runtime_lora_updating=True,
    )
    with running_deployment(e2e_model, 2, 1, router, prefill_engine=engine, decode_engine=engine) as running:
        yield running


def test_models_lists_each_adapter_with_its_base(client, deployment, adapters):
    listed = {m.id: m for m in client.models.list().data}
    base = deployment.router.model_info.name
    assert set(listed) == {base, *adapters}
    for name, (directory, _) in adapters.items():
        extra = listed[name].model_extra
        assert extra["parent"] == base and extra["root"] == str(directory)


def test_each_model_name_answers_with_its_adapter_at_once(client, deployment, e2e_model, adapters):
    """Base and both adapters, several prompts each, sent together: they share the actors'
    batches, and each completion is its own model's."""
    base = deployment.router.model_info.name
    prompts = random_prompts([6, 40, 70], e2e_model.vocab_size, seed=31)
    references = {base: e2e_model.hf_model, **{name: peft_model for name, (_, peft_model) in adapters.items()}}
    jobs = [(name, prompt) for name in references for prompt in prompts]

    def complete(job):
        name, prompt = job
        return client.completions.create(model=name, prompt=prompt, max_tokens=MAX_NEW, **GREEDY)

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(complete, jobs))
    got = {(name, tuple(prompt)): answer for (name, prompt), answer in zip(jobs, answers)}
    for name, prompt in jobs:
        answer = got[name, tuple(prompt)]
        assert answer.model == name
        want = hf_greedy(references[name], prompt, MAX_NEW)
        assert _token_ids(client, answer) == want, f"{name} on a {len(prompt)}-token prompt"
    # The adapters change the answers (else the comparison proves nothing).
    for name in adapters:
        assert any(_token_ids(client, got[name, tuple(p)]) != _token_ids(client, got[base, tuple(p)]) for p in prompts)


def _token_ids(client, completion) -> list[int]:
    return completion.choices[0].model_extra["token_ids"]


def test_unknown_model_is_a_404_and_grpc_names_lora_name(client, deployment, e2e_model, adapters):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-lora", prompt="hi", max_tokens=2)
    assert "no-such-lora" in str(caught.value) and "sql-lora" in str(caught.value)

    grpc_client = Client(deployment.address)
    try:
        (prompt,) = random_prompts([50], e2e_model.vocab_size, seed=33)
        request = dict(prompt_token_ids=prompt, max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        want = hf_greedy(adapters["chat-lora"][1], prompt, MAX_NEW)
        stream = grpc_client.generate(lora_name="chat-lora", **request)
        assert stream.token_ids == want
        assert len(stream.last.prefill_worker_id.split(",")) == 2, "not prefilled by a two-stage pipeline"
        # Again: each stage's prefix cache holds its layers of the prompt through that adapter...
        again = grpc_client.generate(lora_name="chat-lora", **request)
        assert again.token_ids == want and again.last.timing.prompt_tokens_computed < len(prompt)
        # ...which the base model's request for the same prompt does not take.
        base = grpc_client.generate(**request)
        assert base.token_ids == hf_greedy(e2e_model.hf_model, prompt, MAX_NEW)
        assert base.last.timing.prompt_tokens_computed == len(prompt)
        with pytest.raises(grpc.RpcError) as refused:
            grpc_client.generate(lora_name="missing", **request)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND and "lora_name" in refused.value.details()
        info = grpc_client.stub.GetModelInfo(pb.GetModelInfoRequest())
        assert set(info.lora_adapters) == set(adapters)
        assert all(w.num_kv_blocks_used == 0 for w in grpc_client.wait_until_idle())
    finally:
        grpc_client.close()


def test_a_scored_prompt_through_an_adapter_has_peft_log_probabilities(client, e2e_model, adapters):
    (prompt,) = random_prompts([30], e2e_model.vocab_size, seed=35)
    answer = client.completions.create(model="sql-lora", prompt=prompt, max_tokens=1, echo=True, logprobs=0, **GREEDY)
    with torch.no_grad():
        reference = torch.log_softmax(adapters["sql-lora"][1](torch.tensor([prompt])).logits[0].float(), dim=-1)
    got = answer.choices[0].logprobs.token_logprobs[1 : len(prompt)]
    assert got == pytest.approx([float(reference[i, prompt[i + 1]]) for i in range(len(prompt) - 1)], abs=1e-4)


def _post(base_url: str, path: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(base_url + path, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_adapters_loaded_replaced_and_unloaded_at_runtime(client, base_url, deployment, e2e_model, adapters, tmp_path):
    """vLLM's runtime LoRA endpoints, as RL trainers use them: load a policy, replace it in place
    with the next version, unload it; every prefill stage and the decode actor follow, and a
    prefill actor started afterwards is given it before it takes a request."""
    first = build_lora_adapter(e2e_model.hf_model, tmp_path / "v1", seed=41)
    second = build_lora_adapter(e2e_model.hf_model, tmp_path / "v2", seed=42)
    (prompt,) = random_prompts([45], e2e_model.vocab_size, seed=43)

    def answer():
        return _token_ids(client, client.completions.create(model="policy", prompt=prompt, max_tokens=MAX_NEW, **GREEDY))

    assert _post(base_url, "/load_lora_adapter", {"lora_name": "policy", "lora_path": str(tmp_path / "v1")}) == (
        200, "Success: LoRA adapter 'policy' added successfully."
    )
    assert "policy" in {m.id for m in client.models.list().data}
    assert answer() == hf_greedy(first, prompt, MAX_NEW)
    status, body = _post(base_url, "/load_lora_adapter", {"lora_name": "policy", "lora_path": str(tmp_path / "v2")})
    assert status == 400 and "already loaded" in json.loads(body)["error"]["message"]
    assert _post(base_url, "/load_lora_adapter", {"lora_name": "policy", "lora_path": str(tmp_path / "v2"), "load_inplace": True})[0] == 200
    assert answer() == hf_greedy(second, prompt, MAX_NEW)

    # A prefill actor started now is given the adapter before it joins (its pipelines take every
    # actor), and the configured ones: the versions read when they were loaded, which the
    # workers were sent, though the trainer has since written its next version where the loaded
    # one was and the configured directories are gone (as on a node that never had them).
    shutil.move(tmp_path / "v2", tmp_path / "v2-loaded")
    build_lora_adapter(e2e_model.hf_model, tmp_path / "v2", seed=44)
    moved = {name: directory.rename(directory.with_name(directory.name + "-moved")) for name, (directory, _) in adapters.items()}
    admin = Client(deployment.address, deployment.admin_address)
    try:
        admin.admin.ScalePool(pb.ScalePoolRequest(role=pb.WORKER_ROLE_PREFILL, replicas=3))
        joined = deployment.pools.handles["prefill-2"]
        held = ray.get(joined.lora_adapters.remote())
        assert set(held) == {"policy", "sql-lora", "chat-lora"}
        assert held == ray.get(deployment.pools.handles["prefill-0"].lora_adapters.remote()), "the same versions"
        assert answer() == hf_greedy(second, prompt, MAX_NEW)
    finally:
        admin.admin.ScalePool(pb.ScalePoolRequest(role=pb.WORKER_ROLE_PREFILL, replicas=2))
        admin.close()
        for name, (directory, _) in adapters.items():
            moved[name].rename(directory)

    assert _post(base_url, "/unload_lora_adapter", {"lora_name": "policy"}) == (200, "Success: LoRA adapter 'policy' removed successfully.")
    with pytest.raises(openai.NotFoundError):
        answer()
    status, body = _post(base_url, "/unload_lora_adapter", {"lora_name": "policy"})
    assert status == 404 and "policy" in body
    # A directory a worker cannot read: refused naming the field, and served by none.
    status, body = _post(base_url, "/load_lora_adapter", {"lora_name": "broken", "lora_path": str(tmp_path / "missing")})
    assert status == 400 and json.loads(body)["error"]["param"] == "lora_path" and "does not exist" in body
    # The unloaded version is dropped from every worker once no request uses it (a moment later).
    deadline = time.monotonic() + 10
    while any({"policy", "broken"} & set(ray.get(h.lora_adapters.remote())) for h in deployment.pools.handles.values()):
        assert time.monotonic() < deadline, "a worker still serves an unloaded or refused adapter"
        time.sleep(0.2)
