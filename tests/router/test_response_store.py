"""The Responses API's store: bounded, timed, and read back from its file after a restart."""

from __future__ import annotations

import time

import pytest

from router.responses_api.store import ResponseStore, StoredResponse


def _entry(text: str, stored_at: float | None = None) -> StoredResponse:
    entry = StoredResponse({"id": text, "output_text": text}, [{"role": "user", "content": text}])
    if stored_at is not None:
        entry.stored_at = stored_at
    return entry


def test_a_restarted_store_reads_back_what_was_kept_and_forgets_what_was_deleted(tmp_path):
    path = tmp_path / "store.jsonl"
    store = ResponseStore(max_entries=10, ttl_s=60, path=path)
    for i in range(3):
        store.put(f"resp_{i}", _entry(f"answer {i}"))
    assert store.delete("resp_1") and not store.delete("resp_9")
    with path.open("a") as file:
        file.write('{"id": "resp_torn", "entry": {"respo')  # a crash mid-write
    again = ResponseStore(max_entries=10, ttl_s=60, path=path)
    assert len(again) == 2 and again.get("resp_1") is None
    assert again.get("resp_2").conversation == [{"role": "user", "content": "answer 2"}]
    again.put("resp_3", _entry("after the crash"))  # not glued onto the torn line
    assert ResponseStore(max_entries=10, ttl_s=60, path=path).get("resp_3").response["output_text"] == "after the crash"


def test_the_oldest_go_first_past_the_bound_and_expired_ones_are_gone(tmp_path):
    store = ResponseStore(max_entries=3, ttl_s=60)
    for i in range(5):
        store.put(f"resp_{i}", _entry(str(i)))
    assert [store.get(f"resp_{i}") is not None for i in range(5)] == [False, False, True, True, True]
    store.put("old", _entry("old", stored_at=time.time() - 120))
    assert store.get("old") is None


def test_the_file_is_compacted_instead_of_growing_without_bound(tmp_path):
    path = tmp_path / "store.jsonl"
    store = ResponseStore(max_entries=4, ttl_s=60, path=path)
    for i in range(1000):
        store.put(f"resp_{i % 8}", _entry(str(i)))
    assert len(path.read_text().splitlines()) <= 2 * 64 + 1
    again = ResponseStore(max_entries=4, ttl_s=60, path=path)
    assert len(again) == 4 and again.get("resp_7").response["output_text"] == "999"


def test_the_managing_router_also_runs_again_what_replicas_no_longer_run_left_in_progress():
    """A deployment restarted with fewer router replicas: no router named like a removed one
    starts again, so the managing router (router-0) takes what they left in progress; a replica
    takes only its own, and a replica still in the deployment keeps its own."""
    import asyncio

    from router.config import RouterConfig
    from router.responses_api.board import ResponseBoard

    async def scenario():
        board = ResponseBoard(RouterConfig())
        for owner in ("router-0", "router-1", "router-2", "router-5"):
            entry = StoredResponse({"id": f"resp_{owner}", "status": "in_progress", "background": True}, owner=owner, request={"input": "x"})
            await board.put(f"resp_{owner}", entry)
        await board.put("resp_done", StoredResponse({"id": "resp_done", "status": "completed"}, owner="router-3", request={"input": "x"}))
        managing = sorted(rid for rid, _ in await board.in_progress_of("router-0", deployment_routers=2))
        assert managing == ["resp_router-0", "resp_router-2", "resp_router-5"]
        assert [rid for rid, _ in await board.in_progress_of("router-1")] == ["resp_router-1"]
        # The same deployment size as before: each router takes its own only.
        assert [rid for rid, _ in await board.in_progress_of("router-0", deployment_routers=6)] == ["resp_router-0"]

    asyncio.run(scenario())


def test_the_board_hands_a_cancel_to_the_running_router_and_its_final_state_to_the_asker():
    """What crosses routers (router/responses_api/board.py): the asker's cancel wakes the running
    router's wait, and the asker's wait for the final state ends when that router puts it."""
    import asyncio

    from router.config import RouterConfig
    from router.responses_api.board import ResponseBoard

    async def scenario():
        board = ResponseBoard(RouterConfig())
        running = StoredResponse({"id": "resp_bg", "status": "in_progress", "background": True}, owner="router-1", request={"input": "x"})
        await board.put("resp_bg", running)
        # What a router taking router-1's place runs again: its responses in progress only.
        await board.put("resp_other", StoredResponse({"id": "resp_other", "status": "in_progress"}, owner="router-2"))
        assert [rid for rid, _ in await board.in_progress_of("router-1")] == ["resp_bg"]
        assert not await board.wait_for_cancel("resp_bg", 0.01)  # nobody asked yet
        heard = asyncio.create_task(board.wait_for_cancel("resp_bg", 5))
        final = asyncio.create_task(board.wait_until_final("resp_bg", 5))
        await board.request_cancel("resp_bg")
        assert await heard and not final.done()
        await board.put("resp_bg", StoredResponse({"id": "resp_bg", "status": "cancelled", "background": True}))
        assert (await final).response["status"] == "cancelled"
        assert await board.in_progress_of("router-1") == []
        await board.request_cancel("resp_bg")  # finished: nothing to cancel, nothing kept for it
        assert "resp_bg" not in board._cancels
        # Finished, or never stored: answered at once.
        assert (await board.wait_until_final("resp_bg", 5)).response["status"] == "cancelled"
        assert await board.wait_until_final("resp_none", 5) is None
        # A waiter on a response that is deleted meanwhile ends too.
        await board.put("resp_gone", running)
        gone = asyncio.create_task(board.wait_until_final("resp_gone", 5))
        await asyncio.sleep(0)
        assert await board.delete("resp_gone")
        assert await asyncio.wait_for(gone, 1) is None

    asyncio.run(scenario())


def test_the_oldest_go_first_past_the_stores_size_in_bytes(tmp_path):
    """Within the entry bound, a few thousand large conversations (or metadata, tools) filled the
    router's memory: the stored JSON is bounded too, across a restart as well."""
    path = tmp_path / "responses.jsonl"
    store = ResponseStore(max_entries=100, ttl_s=60, path=path, max_bytes=2_500)
    for index in range(4):
        store.put(f"resp_{index}", StoredResponse({"output_text": str(index) * 1_000}))
    assert [response_id for response_id, _ in store.items()] == ["resp_2", "resp_3"] and store.num_bytes <= 2_500
    again = ResponseStore(max_entries=100, ttl_s=60, path=path, max_bytes=2_500)
    assert [response_id for response_id, _ in again.items()] == ["resp_2", "resp_3"]
    store.put("huge", StoredResponse({"output_text": "x" * 10_000}))  # alone past the bound: kept, alone
    assert [response_id for response_id, _ in store.items()] == ["huge"]
    store.delete("huge")
    assert store.num_bytes == 0
    # Entries the bound drops leave no line of their own: the file is rewritten by its size too,
    # and what it holds is read back within the bound (not all of it first).
    for index in range(3_000):
        store.put(f"many_{index}", StoredResponse({"output_text": "é" * 500}))  # 2 bytes a character
    assert path.stat().st_size < 2.2 * (1 << 20) and store.num_bytes <= 2_500
    assert [response_id for response_id, _ in ResponseStore(max_entries=100, ttl_s=60, path=path, max_bytes=2_500).items()] == ["many_2998", "many_2999"]


def test_a_background_response_in_progress_is_never_trimmed():
    """Every request is stored by default, so a few thousand after a background response made
    it the oldest, and the bound dropped it while it ran: other routers answered 404, and if its
    router died, no router ran it again. In progress, it stays; finished, it is trimmed as any."""
    store = ResponseStore(max_entries=3)
    store.put("bg", StoredResponse({"id": "bg", "status": "in_progress"}, owner="router-a", request={"input": "x"}))
    for index in range(5):
        store.put(f"r{index}", StoredResponse({"id": f"r{index}", "status": "completed"}))
    assert [key for key, _ in store.items()] == ["bg", "r3", "r4"]
    store.put("bg", StoredResponse({"id": "bg", "status": "completed"}))  # it finished: the newest now
    store.put("r5", StoredResponse({"id": "r5", "status": "completed"}))
    assert [key for key, _ in store.items()] == ["r4", "bg", "r5"]


def test_a_background_response_whose_router_died_during_each_run_fails_after_a_few():
    """A response that ends its router (a conversation that runs it out of memory) was run again
    at every restart, for good. Its runs are counted on the board, and after BACKGROUND_RUNS it
    fails, saying why."""
    import asyncio
    from types import SimpleNamespace

    from router.responses_api.front_end import BACKGROUND_RUNS, ResponsesFrontEnd

    kept = {}

    async def put(response_id, entry):
        kept[response_id] = entry

    async def prepare(api, response_id):
        raise AssertionError("not run again")

    front_end = SimpleNamespace(store=SimpleNamespace(put=put), _prepare=prepare)
    entry = StoredResponse({"id": "bg", "status": "in_progress"}, owner="router-a", request={"input": "x"}, runs=BACKGROUND_RUNS)
    asyncio.run(ResponsesFrontEnd._run_again(front_end, "bg", entry))
    assert kept["bg"].response["status"] == "failed" and f"{BACKGROUND_RUNS} runs" in kept["bg"].response["error"]["message"]
    assert not kept["bg"].owner  # no longer in progress: no router runs it again


def test_a_background_response_run_again_is_counted_before_anything_of_it_runs():
    """Its run was counted only once it was prepared and admitted; rendering its conversation
    may be what ends the router, and then no run was ever counted."""
    import asyncio
    from types import SimpleNamespace

    from router.responses_api.front_end import ResponsesFrontEnd

    kept = {}

    async def put(response_id, entry):
        kept[response_id] = entry

    class RouterEnds(BaseException):  # (the process ends: no handler of its own runs)
        pass

    async def prepare(api, response_id):
        raise RouterEnds

    front_end = SimpleNamespace(store=SimpleNamespace(put=put), _prepare=prepare)
    entry = StoredResponse({"id": "bg", "status": "in_progress"}, owner="router-a", request={"input": "x"}, runs=1)
    with pytest.raises(RouterEnds):
        asyncio.run(ResponsesFrontEnd._run_again(front_end, "bg", entry))
    assert kept["bg"].runs == 2 and kept["bg"].owner == "router-a"
