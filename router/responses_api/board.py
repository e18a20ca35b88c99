"""Where a deployment's routers keep ``/v1/responses``: one board for all of them.

The store (router/responses_api/store.py) holds the responses; the board adds what crosses
routers. A background response's router puts its state there as it changes (queued, in
progress, final), so any router answers ``GET`` with it; ``cancel`` or ``DELETE`` through another
router asks the board, the running router hears it (it waits on ``wait_for_cancel`` while it
generates) and stops, and the asker waits for the final state (``wait_until_final``). While in
progress the entry names its router and keeps the request: a router that starts in a dead one's
place (the same name: Ray's restart of a replica, a restarted controller, a router restarted over
the same store file) runs what that one left in progress again (``in_progress_of``); the managing
router also runs what a replica the deployment no longer has left (fewer ``router.replicas``).

One router alone keeps a ``ResponseBoard`` in its own process. Routers with replicas share one,
in a Ray actor of the deployment (``start_shared_board``; ``SharedBoard`` is its client), so a
response created through one router is found, continued, cancelled and deleted through any,
whichever router the kernel hands a connection to (they share ports through SO_REUSEPORT). The
actor is the file's one writer (``responses_store_path``) and reads it back when Ray restarts it.
"""

from __future__ import annotations

import asyncio
import logging

from router.config import RouterConfig
from router.responses_api.store import ResponseStore, StoredResponse
from router.shared_actors import find_shared, start_shared

logger = logging.getLogger(__name__)

MAX_BOARD_CALLS = 100_000
IN_PROGRESS = ("queued", "in_progress")  # a background response's states before its final one


def router_name(index: int) -> str:
    """A router's name on the board, the same across its restarts: the managing router is 0,
    replica i is i."""
    return f"router-{index}"


def is_in_progress(entry: StoredResponse | None) -> bool:
    return entry is not None and entry.response.get("status") in IN_PROGRESS


class ResponseBoard:
    """Stored responses plus the cancel requests and final-state waits that cross routers
    (every method is a coroutine: the same calls reach a board in another process)."""

    def __init__(self, config: RouterConfig):
        self.store = ResponseStore(
            config.responses_store_size, config.responses_store_ttl_s, config.responses_store_path, config.responses_store_max_bytes
        )
        self._cancels: dict[str, asyncio.Event] = {}  # response id -> set when a cancel is asked
        self._settled: dict[str, asyncio.Event] = {}  # response id -> set when its final state is put

    async def get(self, response_id: str) -> StoredResponse | None:
        return self.store.get(response_id)

    async def put(self, response_id: str, entry: StoredResponse) -> None:
        self.store.put(response_id, entry)
        if not is_in_progress(entry):
            self._settle(response_id)

    async def replace(self, response_id: str, entry: StoredResponse) -> bool:
        """``put`` where the response is still stored (False: deleted, or expired, meanwhile)."""
        if self.store.get(response_id) is None:
            return False
        await self.put(response_id, entry)
        return True

    async def delete(self, response_id: str) -> bool:
        self._settle(response_id)
        return self.store.delete(response_id)

    async def in_progress_of(self, owner: str, deployment_routers: int | None = None) -> list[tuple[str, StoredResponse]]:
        """The background responses ``owner`` left in progress (it died while running them).
        With ``deployment_routers`` (the managing router's call: how many routers the deployment
        runs now) also those of routers beyond them, a replica the deployment no longer has:
        no router of its name starts again to run them."""
        running = None if deployment_routers is None else {router_name(i) for i in range(deployment_routers)}
        return [
            (response_id, entry)
            for response_id, entry in self.store.items()
            if is_in_progress(entry) and (entry.owner == owner or (running is not None and entry.owner not in running))
        ]

    async def request_cancel(self, response_id: str) -> None:
        """Ask the router running a background response to stop it (one still in progress)."""
        if is_in_progress(self.store.get(response_id)):
            self._event(self._cancels, response_id).set()

    async def wait_for_cancel(self, response_id: str, timeout_s: float) -> bool:
        """True once a cancel is asked for the response; False after ``timeout_s`` without one
        (the running router asks again while it generates)."""
        event = self._event(self._cancels, response_id)
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def wait_until_final(self, response_id: str, timeout_s: float) -> StoredResponse | None:
        """The response once its state is final (None: not stored); its latest state if that
        takes longer than ``timeout_s``."""
        entry = self.store.get(response_id)
        if is_in_progress(entry):
            event = self._event(self._settled, response_id)
            try:
                await asyncio.wait_for(event.wait(), timeout_s)
            except asyncio.TimeoutError:
                logger.warning("response %s: still in progress after %.0f s", response_id, timeout_s)
            entry = self.store.get(response_id)
        return entry

    def _event(self, events: dict[str, asyncio.Event], response_id: str) -> asyncio.Event:
        event = events.get(response_id)
        if event is None:
            event = events[response_id] = asyncio.Event()
        return event

    def _settle(self, response_id: str) -> None:
        """The response is final (or gone): wake whoever waits for that, forget its cancel."""
        self._cancels.pop(response_id, None)
        settled = self._settled.pop(response_id, None)
        if settled is not None:
            settled.set()


class SharedBoard:
    """A ``ResponseBoard`` in the deployment's board actor, called from a router's event loop."""

    def __init__(self, handle):
        self.handle = handle

    async def get(self, response_id: str) -> StoredResponse | None:
        return await self.handle.get.remote(response_id)

    async def put(self, response_id: str, entry: StoredResponse) -> None:
        await self.handle.put.remote(response_id, entry)

    async def replace(self, response_id: str, entry: StoredResponse) -> bool:
        return await self.handle.replace.remote(response_id, entry)

    async def delete(self, response_id: str) -> bool:
        return await self.handle.delete.remote(response_id)

    async def in_progress_of(self, owner: str, deployment_routers: int | None = None) -> list[tuple[str, StoredResponse]]:
        return await self.handle.in_progress_of.remote(owner, deployment_routers)

    async def request_cancel(self, response_id: str) -> None:
        await self.handle.request_cancel.remote(response_id)

    async def wait_for_cancel(self, response_id: str, timeout_s: float) -> bool:
        return await self.handle.wait_for_cancel.remote(response_id, timeout_s)

    async def wait_until_final(self, response_id: str, timeout_s: float) -> StoredResponse | None:
        return await self.handle.wait_until_final.remote(response_id, timeout_s)


def board_name(deployment_name: str) -> str:
    return f"{deployment_name}/responses"


def start_shared_board(deployment_name: str, config: RouterConfig, detached: bool):
    """The deployment's board actor (the one running already, if any: a restarted controller
    finds it by name), on this node: ``responses_store_path`` is a path here. Ray restarts it if
    its process dies."""
    # Coroutines, not threads: every running background response on every router keeps a
    # wait_for_cancel open, and gets and puts must never queue behind those.
    return start_shared(ResponseBoard, board_name(deployment_name), config, max_concurrency=MAX_BOARD_CALLS, detached=detached)


def find_shared_board(deployment_name: str):
    """The deployment's board actor, or None."""
    return find_shared(board_name(deployment_name))
