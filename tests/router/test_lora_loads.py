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
