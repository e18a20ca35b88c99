"""The LoRA adapters a deployment serves, as its router keeps them: those configured
(``lora_modules``) and those loaded and unloaded at runtime (vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``, with ``router.allow_runtime_lora_updating``).

Every worker of both pools serves every adapter: a request may be prefilled by one worker and
decoded by another, so each request is pinned to one version of its adapter (its digest, in
``SamplingParams.lora_digest``) that all its workers compute with. A load goes to all workers at
once and the adapter is named in requests only once each of them serves it; a worker that could
not load it has the others drop it again, and the load is refused with that worker's reason. A
replacement (``load_inplace``) pins new requests to the new version; an unload names the adapter
in no new request; either way the old version is dropped from every worker once no request this
router admitted computes with it. A worker the router starts routing to later (a replacement, a
scale-up, a restarted one) is first given the adapters it lacks and told to drop those unloaded
meanwhile, so no request reaches a worker that cannot serve it. A router that starts over
workers that outlived the one before it (durable workers) takes the adapters they serve that
it does not know as loaded at runtime, with their versions and files (``adopt``), instead of
unloading them: the trainer's loads outlive the router that took them.

Each adapter's digest (``engine.lora_loading.adapter_digest``, what its workers report) salts its
prompts' prefix hashes, as the workers' own caches are salted: KV-aware routing sees the blocks
cached through that adapter only.

A runtime load's directory is read here, where the router can read it, and its files go to the
workers (``workers.adapter_files``): a worker's node needs no copy, and a worker joining later
gets the version loaded even after the trainer has written the next one into the same place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import ray

from engine.block_allocator import adapter_hash_salt
from router.errors import InvalidArgumentError, NotFoundError, remote_cause
from router.pool import WorkerPool
from workers.adapter_files import AdapterFiles

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 300.0  # a large adapter on many GPUs: read, sliced, copied to each device
DROP_POLL_S = 0.2  # how often a replaced or unloaded version's last requests are looked for
DROP_GRACE_S = 1.0  # ... and how long none must be seen before it is dropped
DROP_CLOSE_TIMEOUT_S = 5.0  # how long a closing router tries to drop what it would have dropped later
# A request pinned to a version (at validation) holds it until admitted (a drop in between had
# the workers refuse it: it may wait ~10 s for a reused id, or for its other choices' checks);
# one never admitted (a later choice refused) stops holding it after this long.
PIN_HOLD_S = 60.0


class LoraAdapters:
    """``paths``: name -> adapter directory, shared with the router's model info (the API edges
    read it); ``on_change`` runs after it changes; ``in_flight(digest)``: whether a request this
    router admitted computes with that adapter version."""

    def __init__(
        self,
        paths: dict[str, str],
        pool: WorkerPool,
        on_change: Callable[[], None] = lambda: None,
        in_flight: Callable[[str], bool] = lambda digest: False,
        runtime_updates: bool = False,
    ):
        self.paths = paths
        self.runtime_updates = runtime_updates  # loads at runtime allowed: an adopted worker's are kept
        self.pool = pool
        self.on_change = on_change
        self.in_flight = in_flight
        self.digests: dict[str, str] = {}  # name -> the version requests are pinned to (its workers' digest)
        # name -> a runtime load's files as read here (in Ray's object store), what joining workers get
        self._files: dict[str, object] = {}
        self._lock = asyncio.Lock()  # loads, unloads, drops and a joining worker's catch-up, one at a time
        self._drops: dict[asyncio.Task, str] = {}  # pending drops: task -> the version it drops
        self._pins: dict[str, dict[str, float]] = {}  # version -> request id -> when it was pinned (until admitted)

    def digest(self, name: str | None) -> str | None:
        """The version a new request through ``name`` is pinned to (None: unknown yet, or none)."""
        return None if name is None else self.digests.get(name)

    def pin(self, name: str | None, req_id: str) -> str | None:
        """``digest``, for request ``req_id``, which will compute with it: the version is held
        until ``unpin`` (its admission), not only once admitted (a drop in between had the
        workers refuse it: the client's 400 for a model name that is served)."""
        digest = self.digest(name)
        if digest is not None:
            now = time.monotonic()
            pins = self._pins.setdefault(digest, {})
            for stale in [r for r, at in pins.items() if now - at >= PIN_HOLD_S]:  # never admitted, and no unpin came
                del pins[stale]
            pins[req_id] = now
        return digest

    def unpin(self, digest: str | None, req_id: str) -> None:
        """Request ``req_id`` was admitted (its version is in flight now) or never will be."""
        pins = self._pins.get(digest)
        if pins is not None:
            pins.pop(req_id, None)
            if not pins:
                del self._pins[digest]

    def _pinned(self, digest: str) -> bool:
        now = time.monotonic()
        return any(now - at < PIN_HOLD_S for at in self._pins.get(digest, {}).values())

    def salt(self, name: str | None) -> bytes:
        """The prefix-hash salt of a request through ``name`` (None: the base model)."""
        if name is None:
            return b""
        digest = self.digests.get(name)
        return adapter_hash_salt(digest) if digest is not None else b"lora-name:" + name.encode()

    async def load(self, name: str, adapter_dir: str, replace: bool = False) -> None:
        """Serve ``adapter_dir`` as ``name`` on every worker, then name it in requests.
        ``replace``: a new version of a served adapter; requests pinned to the old one finish
        through it, and it is dropped once none is left."""
        async with self._lock:
            if name in self.paths and not replace:
                raise InvalidArgumentError("lora_name", f"adapter {name!r} is already loaded (load_inplace: true replaces it)")
            records = list(self.pool.workers.values())
            adapter = await _shipped(adapter_dir)
            results = await asyncio.gather(
                *(asyncio.wait_for(r.handle.load_lora_adapter.remote(name, adapter, replace), LOAD_TIMEOUT_S) for r in records),
                return_exceptions=True,
            )
            digests = {result for result in results if isinstance(result, str)}
            # A worker that died needs no copy (its replacement catches up as it joins); one only
            # unreachable for now (ActorUnavailableError) may still be serving, without it: the
            # load fails rather than name an adapter that worker would refuse.
            failed = [(r, e) for r, e in zip(records, results) if isinstance(e, BaseException) and not _worker_died(e)]
            previous = self.digests.get(name)
            if failed or len(digests) > 1:
                # Undone where it loaded (or may still be loading: a drop runs after it there);
                # the version requests are pinned to stays as it was.
                for digest in digests - {previous}:
                    if self._serves(digest):
                        loaded = [r for r, result in zip(records, results) if result == digest]
                        await asyncio.gather(*(self._undo_load(r.handle, name, digest) for r in loaded))
                    else:
                        await self._drop_from(records, digest)
                if failed:
                    record, error = failed[0]
                    raise InvalidArgumentError("lora_path", f"worker {record.worker_id} cannot serve it: {remote_cause(error)}")
                raise InvalidArgumentError("lora_path", f"the workers read different adapters at {adapter_dir!r} (its files differ between nodes)")
            self.paths[name] = adapter_dir
            if adapter is adapter_dir:
                self._files.pop(name, None)
            else:
                self._files[name] = adapter
            if digests:
                self.digests[name] = digests.pop()
            else:
                self.digests.pop(name, None)  # no worker yet: the first to join tells it
            logger.info("LoRA adapter %s served from %s by %d workers", name, adapter_dir, len(records))
            self.on_change()
            if previous is not None and previous != self.digests.get(name):
                self._drop_when_unused(previous)

    async def unload(self, name: str) -> None:
        """Name ``name`` in no new request; its version is dropped once no request uses it."""
        async with self._lock:
            if name not in self.paths:
                raise NotFoundError(f"lora_name: no LoRA adapter named {name!r} is loaded (served: {', '.join(self.paths) or 'none'})")
            del self.paths[name]
            self._files.pop(name, None)
            digest = self.digests.pop(name, None)
            self.on_change()
            # The workers forget the name now, so it can be loaded again at once; the version
            # (requests are pinned to it) is dropped once unused, unless another name serves
            # the same files.
            await self._unload_name(name)
            if digest is not None and not self._serves(digest):
                self._drop_when_unused(digest)
            logger.info("LoRA adapter %s unloaded", name)

    async def catch_up(self, worker_id: str, handle, adopt: bool = False) -> None:
        """Before a worker takes requests: load what it lacks (or holds in another version),
        unload what was unloaded. ``adopt``: a worker this router found running as it started,
        whose adapters it does not know were loaded at runtime before it: they stay served."""
        async with self._lock:
            held: dict[str, str] = await handle.lora_adapters.remote()
            if adopt and self.runtime_updates and held.keys() - self.paths.keys():
                await self._adopt(worker_id, handle, held.keys() - self.paths.keys())
            for name in held.keys() - self.paths.keys():
                await handle.unload_lora_adapter.remote(name)
            for name, adapter_dir in self.paths.items():
                if name in held and self.digests.get(name, held[name]) == held[name]:
                    self.digests.setdefault(name, held[name])
                    continue
                adapter = self._files.get(name, adapter_dir)
                digest = await asyncio.wait_for(handle.load_lora_adapter.remote(name, adapter, name in held), LOAD_TIMEOUT_S)
                if name in held and not self._serves(held[name]):
                    await handle.drop_lora_version.remote(held[name])
                if self.digests.setdefault(name, digest) != digest:
                    await self._undo_load(handle, name, digest)
                    raise InvalidArgumentError("lora_path", f"worker {worker_id} reads another adapter at {adapter_dir!r} than the others")
                logger.info("worker %s: LoRA adapter %s loaded on joining", worker_id, name)

    async def _adopt(self, worker_id: str, handle, names: set[str]) -> None:
        """Serve ``names`` as ``handle``'s worker does: the versions it holds, from what it
        loaded them (its files, where they came as files: what later workers are given)."""
        versions = await handle.lora_adapter_versions.remote()
        for name in sorted(names):
            digest, source, files = versions[name]
            self.paths[name], self.digests[name] = source, digest
            if files is not None:
                self._files[name] = _stored(files)
            logger.info("LoRA adapter %s (%s, loaded from %s before this router started) adopted from %s", name, digest[:12], source, worker_id)
        self.on_change()

    async def close(self) -> None:
        """Stop the pending drops, and drop their versions now (best effort): an unloaded name is
        gone from the workers, so a router that starts over them would never find its version,
        held for good."""
        pending = set(self._drops.values())
        for task in list(self._drops):
            task.cancel()
        await asyncio.gather(*self._drops, return_exceptions=True)
        records = list(self.pool.workers.values())
        drops = [self._drop_from(records, digest) for digest in pending if not self._serves(digest)]
        with contextlib.suppress(Exception):  # all at once, bounded together: a hung worker holds none up for long
            await asyncio.wait_for(asyncio.gather(*drops, return_exceptions=True), DROP_CLOSE_TIMEOUT_S)

    def _serves(self, digest: str) -> bool:
        """Whether some name gives new requests this version."""
        return digest in self.digests.values()

    async def _undo_load(self, handle, name: str, digest: str) -> None:
        """``handle``'s worker no longer serves ``name`` as ``digest``, a version it just loaded:
        the version is dropped there unless another name serves the same files."""
        if self._serves(digest):
            await handle.unload_lora_adapter.remote(name)
        else:
            await handle.drop_lora_version.remote(digest)

    async def _unload_name(self, name: str) -> None:
        """Every worker forgets ``name``, keeping its version (dropped by ``_drop_when_unused``)."""
        await _on_each(list(self.pool.workers.values()), lambda handle: handle.unload_lora_adapter.remote(name, True), f"unloading LoRA adapter {name}")

    def _drop_when_unused(self, digest: str) -> None:
        """Drop a version from every worker once no admitted request computes with it (a request
        validated just before it stopped being named gets a moment to be admitted), unless a
        name took up the same files meanwhile."""

        async def drop() -> None:
            idle_since = None
            loop = asyncio.get_running_loop()
            while idle_since is None or loop.time() - idle_since < DROP_GRACE_S:
                if self.in_flight(digest) or self._pinned(digest):
                    idle_since = None
                elif idle_since is None:
                    idle_since = loop.time()
                await asyncio.sleep(DROP_POLL_S)
            async with self._lock:
                if not self._serves(digest):  # not loaded again meanwhile
                    await self._drop_from(list(self.pool.workers.values()), digest)
                    self._pins.pop(digest, None)

        task = asyncio.get_running_loop().create_task(drop())
        self._drops[task] = digest
        task.add_done_callback(lambda done: self._drops.pop(done, None))

    @staticmethod
    async def _drop_from(records, digest: str) -> None:
        await _on_each(records, lambda handle: handle.drop_lora_version.remote(digest), f"dropping LoRA adapter version {digest[:12]}")


async def _on_each(records, call: Callable, what: str) -> None:
    """``call`` on every worker's handle at once; a failure other than a worker gone is logged."""
    results = await asyncio.gather(*(call(r.handle) for r in records), return_exceptions=True)
    for record, result in zip(records, results):
        if isinstance(result, BaseException) and not _worker_gone(result):
            logger.warning("worker %s: %s failed: %r", record.worker_id, what, result)


def lora_name_problem(name: str) -> str | None:
    """What is wrong with an adapter's name (None: nothing). A name is written in log lines,
    /v1/models and the comma-separated adapter lists of the lora_requests_info metric."""
    if not name:
        return "must be a non-empty name"
    if len(name) > 256 or "," in name or not name.isprintable():
        return f"must be at most 256 printable characters without commas, got {name[:64]!r}"
    return None


def _worker_gone(error: BaseException) -> bool:
    from router.dispatcher import WORKER_GONE  # the dispatcher imports Ray's errors; keep this module light

    return isinstance(error, WORKER_GONE)


def _worker_died(error: BaseException) -> bool:
    """Whether the call failed because its worker is dead for good (workers are never restarted
    by Ray: their replacements are new actors), not merely unreachable for now."""
    from ray.exceptions import ActorUnavailableError

    return _worker_gone(error) and not isinstance(error, ActorUnavailableError)


async def _shipped(adapter_dir: str):
    """What a load hands the workers: the adapter's files as read here, put in Ray's object store
    once for all of them (a worker is handed the files themselves); ``adapter_dir`` itself where
    it is no directory here (a Hugging Face id; a path on the workers' nodes only), or outside Ray
    (a router over stand-in workers)."""
    files = await asyncio.to_thread(AdapterFiles.read, adapter_dir)
    return adapter_dir if files is None else _stored(files)


def _stored(files: AdapterFiles):
    """``files`` in Ray's object store (once for every worker handed them), or as they are outside Ray."""
    return ray.put(files) if ray.is_initialized() else files
