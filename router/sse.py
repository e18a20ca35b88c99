"""Server-sent events, as every streaming HTTP front end of the router writes them."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


def event_stream() -> web.StreamResponse:
    """A response that streams events (prepared by the caller with its first one)."""
    return web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})


async def send(response: web.StreamResponse, payload: dict[str, Any], named: bool = False) -> None:
    """One event: ``data: <json>``, after ``event: <payload type>`` where the API names its events
    (the Responses and Messages APIs; chat completions sends data lines only)."""
    head = f"event: {payload['type']}\n" if named else ""
    await response.write(f"{head}data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode())
