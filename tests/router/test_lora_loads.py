"""Loading a LoRA adapter at runtime over the pool's workers: a worker that is only unreachable
for now fails the load (it may still serve, without the adapter); a worker that died needs none."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from router.errors import InvalidArgumentError
from router.lora_adapters import LoraAdapters
from router.pool import Role, WorkerPool, WorkerRecord


class _Call:
    def __init__(self, outcome):
        self.outcome = outcome

    def remote(self, *args):
        async def answer():
            if isinstance(self.outcome, BaseException):
                raise self.outcome
            return self.outcome
        return answer()


def _worker(worker_id: str, load_outcome) -> WorkerRecord:
    handle = SimpleNamespace(load_lora_adapter=_Call(load_outcome), drop_lora_version=_Call(None))
    return WorkerRecord(worker_id, Role.DECODE, handle=handle)


@pytest.mark.parametrize("error, loads", [(ActorDiedError(), True), (ActorUnavailableError("unreachable", None), False)])
def test_a_load_fails_where_a_worker_is_unreachable_not_where_it_died(tmp_path, error, loads):
    pool = WorkerPool()
    pool.add(_worker("decode-0", "digest-a"))
    pool.add(_worker("decode-1", error))
    adapters = LoraAdapters({}, pool)
    (tmp_path / "adapter").mkdir()

    async def scenario():
        await adapters.load("sql", str(tmp_path / "adapter"))

    if loads:
        asyncio.run(scenario())
        assert adapters.paths == {"sql": str(tmp_path / "adapter")} and adapters.digests == {"sql": "digest-a"}
    else:
        with pytest.raises(InvalidArgumentError) as refused:
            asyncio.run(scenario())
        assert refused.value.field == "lora_path" and "decode-1" in refused.value.problem
        assert adapters.paths == {}


class _EngineWorker:
    """A worker's LoRA calls answered by a real engine (the actor's own methods do the same
    through its engine thread)."""

    def __init__(self, engine):
        self.engine = engine
        self.lora_adapters = _Answer(lambda: engine.adapters.served)
        self.load_lora_adapter = _Answer(self._load)
        self.unload_lora_adapter = _Answer(engine.unload_adapter)
        self.drop_lora_version = _Answer(engine.drop_adapter_version)

    def _load(self, name, adapter, replace=False):
        import ray

        if isinstance(adapter, ray.ObjectRef):  # Ray started in this process (by another test): as an actor call resolves it
            adapter = ray.get(adapter)
        with adapter.written() as directory:
            return self.engine.load_adapter(name, str(directory), replace)


class _Answer:
    def __init__(self, method):
        self.method = method

    def remote(self, *args):
        async def answer():
            return self.method(*args)
        return answer()


def test_two_names_for_the_same_files_are_unloaded_and_loaded_one_at_a_time(tmp_path):
    """An unloaded name can be loaded again at once, with other files (it was refused as already
    loaded until its version's last requests ended and a grace passed). One adapter's files
    served under two names share a version on the workers: unloading one name leaves the other
    served (by the running workers and by one that joins later)."""
    from engine import EngineConfig, LLMEngine, SamplingParams
    from tests.checkpoints import build_checkpoint, build_lora_adapter, hf_greedy

    model = build_checkpoint("llama", tmp_path / "base")
    shared = build_lora_adapter(model, tmp_path / "shared", seed=21)
    other = build_lora_adapter(model, tmp_path / "other", seed=22)

    def engine():
        return LLMEngine(tmp_path / "base", EngineConfig(num_kv_blocks=64, num_threads=1))

    pool = WorkerPool()
    pool.add(WorkerRecord("decode-0", Role.DECODE, handle=_EngineWorker(engine())))
    adapters = LoraAdapters({}, pool)
    prompt = [5, 17, 3, 99, 42, 8]

    def answer(worker, name):
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, lora_name=name, lora_digest=adapters.digest(name))
        request = worker.engine.add_request(f"{name}-{len(worker.engine.scheduler.requests)}", prompt, params)
        while worker.engine.has_unfinished_requests():
            worker.engine.step()
        return request.output_token_ids

    async def scenario():
        await adapters.load("alpha", str(tmp_path / "other"))
        await adapters.unload("alpha")  # alone on its version: loaded again at once, as a trainer reloads a checkpoint
        await adapters.load("alpha", str(tmp_path / "shared"))
        await adapters.unload("alpha")
        await adapters.load("alpha", str(tmp_path / "shared"))
        await adapters.load("beta", str(tmp_path / "shared"))
        assert adapters.digest("alpha") == adapters.digest("beta")
        await adapters.unload("alpha")
        joining = _EngineWorker(engine())
        joining.engine.load_adapter("alpha", str(tmp_path / "shared"))  # a durable worker that missed the unload
        joining.engine.load_adapter("beta", str(tmp_path / "shared"))
        await adapters.catch_up("decode-1", joining)
        pool.add(WorkerRecord("decode-1", Role.DECODE, handle=joining))
        await adapters.load("alpha", str(tmp_path / "other"))
        await adapters.close()
        return joining

    joining = asyncio.run(scenario())
    expected = {"alpha": hf_greedy(other, prompt, 6), "beta": hf_greedy(shared, prompt, 6)}
    for worker in (pool.workers["decode-0"].handle, joining):
        assert worker.engine.adapters.served.keys() == {"alpha", "beta"}
        assert {name: answer(worker, name) for name in expected} == expected


def test_a_router_closing_before_an_unloaded_version_is_dropped_drops_it_then(tmp_path):
    """An unload has every worker forget the name at once and drops its version once unused. A
    router closed before then (a restart over durable workers) left the version held, nameless,
    where no later router could find it: its slot and weights, for good."""
    from engine import EngineConfig, LLMEngine
    from tests.checkpoints import build_checkpoint, build_lora_adapter

    model = build_checkpoint("llama", tmp_path / "base")
    build_lora_adapter(model, tmp_path / "policy", seed=31)
    worker = _EngineWorker(LLMEngine(tmp_path / "base", EngineConfig(num_kv_blocks=32, num_threads=1)))
    pool = WorkerPool()
    pool.add(WorkerRecord("decode-0", Role.DECODE, handle=worker))
    in_flight = {"yes": True}
    adapters = LoraAdapters({}, pool, in_flight=lambda digest: in_flight["yes"])

    async def scenario():
        await adapters.load("policy", str(tmp_path / "policy"))
        await adapters.unload("policy")
        assert worker.engine.adapters.slots, "kept while a request computes with it"
        await adapters.close()

    asyncio.run(scenario())
    assert not worker.engine.adapters.served and not worker.engine.adapters.slots


def test_an_adapter_name_with_a_line_break_or_a_comma_is_refused():
    """A name goes into log lines, /v1/models and the lora_requests_info metric's comma-separated
    lists: a newline forged log lines, a comma split one adapter into two in the metric. A load
    refuses such a name (as the configuration does); an unload only looks the name up."""
    from router.lora_adapters import lora_name_problem
    from router.openai_api.vllm_endpoints import VllmEndpoints

    for name in ("sql-adapter_v2.1", "org/adapter", "a:v1", "with space", "été"):
        assert lora_name_problem(name) is None, name
    for name in ("sql\nINFO forged", "a,b", "x" * 300, "tab\there", ""):
        assert lora_name_problem(name) is not None, name

    endpoints = object.__new__(VllmEndpoints)
    endpoints.server = SimpleNamespace(model_names=["base"], model_aliases=[])

    async def read_json(request):
        return {"lora_name": "a,b", "lora_path": "/adapters/x"}

    endpoints.server.read_json = read_json
    endpoints.router = SimpleNamespace(config=SimpleNamespace(allow_runtime_lora_updating=True))
    with pytest.raises(InvalidArgumentError) as refused:
        asyncio.run(endpoints.load_lora_adapter(None))
    assert refused.value.field == "lora_name"
    assert endpoints._lora_body({"lora_name": "a,b"}, {"lora_name"})["lora_name"] == "a,b"  # an unload's


def test_a_replaced_version_is_held_for_a_request_pinned_to_it_until_it_is_admitted(tmp_path, monkeypatch):
    """A request is pinned to its adapter's version at validation and admitted after (it may wait
    ~10 s for a reused id): the replaced version was dropped in between when nothing admitted
    used it, and the workers refused the request (a 400 for a model name that is served)."""
    from engine import EngineConfig, LLMEngine
    from router import lora_adapters
    from tests.checkpoints import build_checkpoint, build_lora_adapter

    monkeypatch.setattr(lora_adapters, "DROP_POLL_S", 0.02)
    monkeypatch.setattr(lora_adapters, "DROP_GRACE_S", 0.05)
    model = build_checkpoint("llama", tmp_path / "base")
    build_lora_adapter(model, tmp_path / "v1", seed=41)
    build_lora_adapter(model, tmp_path / "v2", seed=42)
    worker = _EngineWorker(LLMEngine(tmp_path / "base", EngineConfig(num_kv_blocks=32, num_threads=1)))
    pool = WorkerPool()
    pool.add(WorkerRecord("decode-0", Role.DECODE, handle=worker))
    adapters = LoraAdapters({}, pool)

    async def scenario():
        await adapters.load("policy", str(tmp_path / "v1"))
        old = adapters.pin("policy", "waiting-request")  # validated, not admitted yet
        await adapters.load("policy", str(tmp_path / "v2"), replace=True)
        await asyncio.sleep(0.5)
        held = set(worker.engine.adapters.slots)
        adapters.unpin(old, "waiting-request")  # admitted (in flight from here) or refused
        await asyncio.sleep(0.5)
        return old, held, set(worker.engine.adapters.slots)

    old, held, after = asyncio.run(scenario())
    assert old in held, "dropped under a request pinned to it"
    assert after == {adapters.digest("policy")} and old not in after


def test_pins_of_requests_never_admitted_do_not_pile_up(monkeypatch):
    """A choice refused after its pin (another choice's bad value, a full queue) is unpinned by
    its handler; one whose unpin never came stops counting after PIN_HOLD_S and is dropped from
    the version's pins at the next pin (they grew for as long as the adapter stayed loaded)."""
    from router import lora_adapters

    adapters = LoraAdapters({}, WorkerPool())
    adapters.digests["policy"] = "v1"
    monkeypatch.setattr(lora_adapters, "PIN_HOLD_S", 0.0)
    for index in range(100):
        adapters.pin("policy", f"never-admitted-{index}")
    assert len(adapters._pins["v1"]) == 1 and not adapters._pinned("v1")
