"""A background response's task ends by its own finally however it is stopped: its final state is
kept and its session closed (the request let go at the router), even when a cancel comes in the
same turn of the event loop as the response is started (a response run again after a router
restart, whose id its client already knows)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from router.responses_api import front_end
from router.responses_api.front_end import ResponsesFrontEnd, ResponseState


class _Session:
    def __init__(self):
        self.closed = False

    async def chunks(self):
        await asyncio.sleep(3600)  # generating until cancelled
        yield None

    def close(self):
        self.closed = True
        return asyncio.sleep(0)


class _Board:
    def __init__(self):
        self.kept: dict[str, dict] = {}

    async def put(self, response_id, entry):
        self.kept[response_id] = entry.response

    async def wait_for_cancel(self, response_id, timeout_s):
        await asyncio.sleep(timeout_s)
        return False


def test_a_background_response_cancelled_in_the_turn_it_starts_closes_its_session_and_keeps_cancelled(monkeypatch):
    session = _Session()

    async def open_session(router, validated, client_gone):
        return session

    monkeypatch.setattr(front_end.GenerationSession, "open", open_session)
    front = object.__new__(ResponsesFrontEnd)
    front.router = SimpleNamespace(board_name="router-0")
    front.store = _Board()
    front.background = {}
    api = SimpleNamespace(store=True, input_items=[])
    state = ResponseState("resp_1", "m", {}, 3, None)

    async def scenario():
        def cancel_handled_now():  # a cancel request handled before the task's first step
            running = front.background.get("resp_1")
            if running is not None:
                running.task.cancel()

        asyncio.get_running_loop().call_soon(cancel_handled_now)
        await front._start_background(api, {}, state, None, [])
        await front._stop_running("resp_1")  # and the client's cancel, now
        await asyncio.sleep(0.01)

    asyncio.run(scenario())
    assert session.closed, "the request is let go at the router"
    assert front.store.kept["resp_1"]["status"] == "cancelled"
    assert "resp_1" not in front.background


def test_a_previous_response_still_running_is_refused_naming_the_field():
    """Its answer is not written yet: the next turn went on from half a turn (or none)."""
    import pytest

    from router.errors import InvalidArgumentError
    from router.responses_api.store import StoredResponse

    kept = {
        "resp_running": StoredResponse({"id": "resp_running", "status": "in_progress"}, [{"role": "user", "content": "hi"}]),
        "resp_done": StoredResponse({"id": "resp_done", "status": "completed"},
                                    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]),
    }

    class Store:
        async def get(self, response_id):
            return kept.get(response_id)

    front = object.__new__(ResponsesFrontEnd)
    front.store = Store()
    with pytest.raises(InvalidArgumentError) as raised:
        asyncio.run(front._prior(SimpleNamespace(previous_response_id="resp_running")))
    assert raised.value.field == "previous_response_id" and "still in_progress" in str(raised.value)
    assert asyncio.run(front._prior(SimpleNamespace(previous_response_id="resp_done")))[-1]["content"] == "hello"
