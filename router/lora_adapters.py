"""The LoRA adapters a deployment serves, as its router keeps them: those configured
(``lora_modules``) and those loaded and unloaded at runtime (vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``, with ``router.allow_runtime_lora_updating``).

Every worker of both pools serves every adapter: a request may be prefilled by one worker and
decoded by another. A load goes to all workers at once and the adapter is named in requests
only once each of them serves it; a worker that could not load it has the others unload it
again, and the load is refused with that worker's reason. An unload stops new requests at once;
running ones finish through the adapter on their workers. A worker the router starts routing to
later (a replacement, a scale-up, a restarted one) is first given the adapters it lacks and told
to drop those unloaded meanwhile, so no request reaches a worker that cannot serve it.

Each adapter's digest (``engine.lora.adapter_digest``, what its workers report) salts its
prompts' prefix hashes, as the workers' own caches are salted: KV-aware routing sees the blocks
cached through that adapter only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from engine.block_allocator import adapter_hash_salt
from router.errors import InvalidArgumentError, NotFoundError, remote_cause
from router.pool import WorkerPool

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 300.0  # a large adapter on many GPUs: read, sliced, copied to each device


class LoraAdapters:
    """``paths``: name -> adapter directory, shared with the router's model info (the API edges
    read it); ``on_change`` runs after it changes."""

    def __init__(self, paths: dict[str, str], pool: WorkerPool, on_change: Callable[[], None] = lambda: None):
        self.paths = paths
        self.pool = pool
        self.on_change = on_change
        self.digests: dict[str, str] = {}  # learned from the workers that load them
        self._lock = asyncio.Lock()  # loads, unloads and a joining worker's catch-up, one at a time

    def salt(self, name: str | None) -> bytes:
        """The prefix-hash salt of a request through ``name`` (None: the base model)."""
        if name is None:
            return b""
        digest = self.digests.get(name)
        return adapter_hash_salt(digest) if digest is not None else b"lora-name:" + name.encode()

    async def load(self, name: str, adapter_dir: str, replace: bool = False) -> None:
        """Serve ``adapter_dir`` as ``name`` on every worker, then name it in requests.
        ``replace``: a new version of a served adapter (running requests keep the old one)."""
        async with self._lock:
            if name in self.paths and not replace:
                raise InvalidArgumentError("lora_name", f"adapter {name!r} is already loaded (load_inplace: true replaces it)")
            records = list(self.pool.workers.values())
            results = await asyncio.gather(
                *(asyncio.wait_for(r.handle.load_lora_adapter.remote(name, adapter_dir, replace), LOAD_TIMEOUT_S) for r in records),
                return_exceptions=True,
            )
            loaded = [(r, digest) for r, digest in zip(records, results) if isinstance(digest, str)]
            failed = [(r, error) for r, error in zip(records, results) if isinstance(error, BaseException) and not _worker_gone(error)]
            digests = {digest for _, digest in loaded}
            if failed or len(digests) > 1:
                if name not in self.paths:  # a replacement leaves the old version served where it loaded
                    await self._unload_from([r for r, _ in loaded], name)
                if failed:
                    record, error = failed[0]
                    raise InvalidArgumentError("lora_path", f"worker {record.worker_id} cannot serve it: {remote_cause(error)}")
                raise InvalidArgumentError("lora_path", f"the workers read different adapters at {adapter_dir!r} (its files differ between nodes)")
            self.paths[name] = adapter_dir
            if digests:
                self.digests[name] = digests.pop()
            logger.info("LoRA adapter %s served from %s by %d workers", name, adapter_dir, len(loaded))
            self.on_change()

    async def unload(self, name: str) -> None:
        """Name ``name`` in no new request; every worker drops it once its requests end."""
        async with self._lock:
            if name not in self.paths:
                raise NotFoundError(f"lora_name: no LoRA adapter named {name!r} is loaded (served: {', '.join(self.paths) or 'none'})")
            del self.paths[name]
            self.digests.pop(name, None)
            self.on_change()
            await self._unload_from(list(self.pool.workers.values()), name)
            logger.info("LoRA adapter %s unloaded", name)

    async def catch_up(self, worker_id: str, handle) -> None:
        """Before a worker takes requests: load what it lacks, unload what was unloaded."""
        async with self._lock:
            held: dict[str, str] = await handle.lora_adapters.remote()
            for name in held.keys() - self.paths.keys():
                await handle.unload_lora_adapter.remote(name)
            for name, adapter_dir in self.paths.items():
                stale = name in held and name in self.digests and held[name] != self.digests[name]  # replaced while it started
                if name not in held or stale:
                    held[name] = await asyncio.wait_for(handle.load_lora_adapter.remote(name, adapter_dir, stale), LOAD_TIMEOUT_S)
                    logger.info("worker %s: LoRA adapter %s loaded on joining", worker_id, name)
                self.digests.setdefault(name, held[name])

    @staticmethod
    async def _unload_from(records, name: str) -> None:
        results = await asyncio.gather(*(r.handle.unload_lora_adapter.remote(name) for r in records), return_exceptions=True)
        for record, result in zip(records, results):
            if isinstance(result, BaseException) and not _worker_gone(result):
                logger.warning("worker %s: unloading LoRA adapter %s failed: %r", record.worker_id, name, result)


def _worker_gone(error: BaseException) -> bool:
    from router.dispatcher import WORKER_GONE  # the dispatcher imports Ray's errors; keep this module light

    return isinstance(error, WORKER_GONE)
