"""Stored responses: what ``GET /v1/responses/{id}`` returns and what ``previous_response_id``
continues.

Bounded (the oldest go first past ``max_entries``, or past ``max_bytes`` of their JSON: a few
thousand large conversations filled the router's memory within the entry bound) and timed (an
entry older than ``ttl_s`` is gone). With a ``path``, every change is appended to a JSON-lines file and the file is read back
at start, so stored conversations survive a router restart; the file is rewritten with the live
entries when it holds more than twice as many records as there are entries.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as GET returns it
    conversation: list[dict[str, Any]] = field(default_factory=list)  # chat-template messages through this response's output
    stored_at: float = field(default_factory=time.time)  # wall clock: survives restarts
    # A background response in progress: the router running it (its name on the board) and the
    # request body, from which a router taking that one's place after its death runs it again.
    owner: str = ""
    request: dict[str, Any] | None = None
    runs: int = 1  # its runs started so far (each after its router died during the one before)
    input_items: list[dict[str, Any]] = field(default_factory=list)  # the call's input, as GET .../input_items lists it


class ResponseStore:
    def __init__(self, max_entries: int = 10_000, ttl_s: float = 3600.0, path: Path | None = None, max_bytes: int = 1 << 30):
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.path = Path(path) if path is not None else None
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._sizes: dict[str, int] = {}  # response id -> its entry's JSON size, in bytes
        self.num_bytes = 0
        self._file_bytes = 0  # the file's size (rewritten once twice the live entries' and more)
        self._records = 0  # lines in the file
        if self.path is not None:
            self._load()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        entry = self._entries.get(response_id)
        if entry is not None and entry.stored_at < time.time() - self.ttl_s:
            return None  # entries expire in insertion order; one put with an old time is caught here
        return entry

    def items(self) -> list[tuple[str, StoredResponse]]:
        """Every live entry, oldest first."""
        self._expire()
        return list(self._entries.items())

    def put(self, response_id: str, entry: StoredResponse) -> None:
        record = json.dumps({"id": response_id, "entry": asdict(entry)}, ensure_ascii=False)
        size = len(record.encode())
        self._forget(response_id)
        self._keep(response_id, entry, size)
        self._append(record, size)

    def delete(self, response_id: str) -> bool:
        if not self._forget(response_id):
            return False
        self._append(json.dumps({"id": response_id, "deleted": True}))
        return True

    def _keep(self, response_id: str, entry: StoredResponse, size: int) -> None:
        self._entries[response_id] = entry
        self._sizes[response_id] = size
        self.num_bytes += size
        self._trim()

    def _forget(self, response_id: str) -> bool:
        if self._entries.pop(response_id, None) is None:
            return False
        self.num_bytes -= self._sizes.pop(response_id, 0)
        return True

    def _trim(self) -> None:
        """The oldest go until the entries fit both bounds (the newest stays, whatever its size),
        except background responses in progress: dropped, a running one answered 404 at the
        other routers, and was never run again if its router died (a few thousand requests
        stored after it made it the oldest)."""
        while len(self._entries) > self.max_entries or (self.num_bytes > self.max_bytes and len(self._entries) > 1):
            newest = next(reversed(self._entries))
            oldest = next((key for key, entry in self._entries.items() if not entry.owner and key != newest), None)
            if oldest is None:
                break
            self._forget(oldest)

    def _expire(self) -> None:
        oldest = time.time() - self.ttl_s
        while self._entries:
            response_id, entry = next(iter(self._entries.items()))
            if entry.stored_at >= oldest:
                break
            self._forget(response_id)

    def _append(self, record: str, size: int | None = None) -> None:
        """``record`` as the file's next line (``size``: its UTF-8 length, where known)."""
        if self.path is None:
            return
        # Rewritten once it holds twice the live records, or twice their bytes (entries the bounds
        # dropped have no line of their own: read back, they would all come in again).
        if self._records > 2 * max(len(self._entries), 64) or self._file_bytes > 2 * max(self.num_bytes, 1 << 20):
            self._rewrite()
            return
        with self.path.open("a", encoding="utf-8") as file:
            file.write(record + "\n")
        self._records += 1
        self._file_bytes += (len(record.encode()) if size is None else size) + 1

    def _rewrite(self) -> None:
        scratch = self.path.with_suffix(self.path.suffix + ".tmp")
        with scratch.open("w", encoding="utf-8") as file:
            for response_id, entry in self._entries.items():
                file.write(json.dumps({"id": response_id, "entry": asdict(entry)}, ensure_ascii=False) + "\n")
        os.replace(scratch, self.path)
        self._records = len(self._entries)
        self._file_bytes = self.path.stat().st_size

    def _load(self) -> None:
        if not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return
        with self.path.open(encoding="utf-8") as file:
            for number, line in enumerate(file, 1):
                self._records += 1
                try:
                    record = json.loads(line)
                    self._forget(record["id"])
                    if not record.get("deleted"):  # held to the bounds as it is read, as when it was put
                        self._keep(record["id"], StoredResponse(**record["entry"]), len(line.rstrip("\n").encode()))
                except (json.JSONDecodeError, KeyError, TypeError) as exc:  # a torn last line after a crash
                    logger.warning("%s:%d: skipped a stored response that does not read back: %s", self.path, number, exc)
        self._expire()
        self._rewrite()  # compacted, and never ending in a torn line the next append would extend
        logger.info("read %d stored responses from %s", len(self._entries), self.path)
