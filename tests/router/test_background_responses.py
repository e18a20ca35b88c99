"""A background response's task ends by its own finally however it is stopped: its final state is
kept and its session closed (the request let go at the router), even when a cancel comes in the
same turn of the event loop as the response is started (a response run again after a router
restart, whose id its client already knows)."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

import pytest

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


class _KeepingBoard:
    """The board's put, replace and delete, as ResponseBoard does them."""

    def __init__(self, left=()):
        self.kept: dict = {}
        self.left = list(left)

    async def put(self, response_id, entry):
        self.kept[response_id] = entry

    async def replace(self, response_id, entry):
        if response_id not in self.kept:
            return False
        self.kept[response_id] = entry
        return True

    async def get(self, response_id):
        return self.kept.get(response_id)

    async def delete(self, response_id):
        return self.kept.pop(response_id, None) is not None

    async def in_progress_of(self, owner, deployment_routers=None):
        return self.left


def _answering_front(board):
    front = object.__new__(ResponsesFrontEnd)
    front.router = SimpleNamespace(board_name="router-0", deployment_routers=1, background_tasks=set())
    front.store = board
    front.background = {}
    front.answering = {}
    return front


def test_a_stored_answer_is_on_the_board_while_it_runs_and_never_left_in_progress():
    """A streamed or awaited ``store: true`` response was a 404 for GET until it ended; a client
    that went away mid-answer, or a stream that broke, would now leave it "in_progress" for
    good unless its end is kept. A DELETE while it runs stays deleted."""
    api = SimpleNamespace(store=True, input_items=[{"id": "msg_1"}])

    async def run(outcome):
        board = _KeepingBoard()
        front = _answering_front(board)
        state = ResponseState("resp_1", "m", {}, 3, None)
        seen = {}
        with pytest.raises(BaseException) if outcome in ("gone", "broke") else contextlib.nullcontext():
            async with front._on_board_while_answered(api, state, []):
                seen["board"] = board.kept["resp_1"].response["status"]
                seen["live"] = front.answering["resp_1"] is state
                if outcome == "gone":
                    raise asyncio.CancelledError()
                if outcome == "broke":
                    raise RuntimeError("the stream broke")
                if outcome == "deleted":
                    await board.delete("resp_1")
                state.status = "completed"
                await front._keep(api, state, [], answered=True)
        assert seen == {"board": "in_progress", "live": True} and not front.answering
        return board.kept.get("resp_1")

    assert asyncio.run(run("completed")).response["status"] == "completed"
    assert asyncio.run(run("gone")).response["status"] == "cancelled"
    broke = asyncio.run(run("broke")).response
    assert broke["status"] == "failed" and broke["error"]["code"] == "server_error"
    assert asyncio.run(run("deleted")) is None, "deleted while it ran: its end does not bring it back"


def test_a_stored_answer_its_router_died_in_is_failed_at_that_routers_next_start():
    """The client of a streamed answer lost its connection with the router; the entry stayed in
    progress on the board (a follow-up naming it was refused as still running) until it expired."""
    from router.responses_api.store import StoredResponse

    left = StoredResponse({"id": "resp_1", "status": "in_progress", "background": False}, [{"role": "user", "content": "hi"}], owner="router-0")
    board = _KeepingBoard([("resp_1", left)])
    front = _answering_front(board)
    asyncio.run(front.resume())
    kept = board.kept["resp_1"]
    assert kept.response["status"] == "failed" and "died" in kept.response["error"]["message"]
    assert kept.conversation == left.conversation and not kept.owner
