"""The scaffolding every pdserve worker actor shares, written once.

A worker runs its engine on a thread of its own (``EngineThread``: the actor's event loop stays
free to answer calls while a step computes), registers the engine's KV cache with a KV agent,
and drives the agent's transfers from a pump thread. Around that sit the calls every worker
answers the same way: ``ping`` (the health check: is the engine thread alive and making
progress, is the pump alive), ``drain``, ``set_step_delay`` (fault injection for tests and
drills), ``cache_events`` (what its prefix cache stored and evicted, for a router's index)
and ``shutdown``. ``PrefillWorker`` and ``DecodeWorker`` add their own request lifecycles and
their ``_iterate`` (one turn of the engine thread).

With ``tensor_parallel_size`` > 1 this actor is rank 0 of the worker's ranks
(``workers.ranks``): its engine drives the others, its KV agent writes and reads through every
rank's transport, and the worker lives and dies as one: a collective that fails (another rank
died) ends this process at once, so the router retries or migrates its requests as for any
dead worker, and the pool replaces all of it (a new epoch for every rank).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray

from engine.config import EngineConfig
from engine.engine_thread import EngineThread
from engine.llm_engine import LLMEngine
from engine.model_source import resolve_model
from engine.parallel.group import RankFailedError
from engine.step_profile import StepLog, TransferRecord
from engine.stats import WorkerState
from kvtransfer.activations import ActivationChannel
from kvtransfer.agent import KVAgent, KVTransferConfig
from kvtransfer.errors import BackendUnavailableError
from kvtransfer.layout import KVCompat
from kvtransfer.pump import TransferPump
from kvtransfer.sharding import KVShard
from workers.adapter_files import AdapterFiles
from workers.cache_events import CacheEventLog, CacheUpdate
from workers.ranks import RayRankLauncher, node_name

logger = logging.getLogger(__name__)

RANK_LOST_EXIT_CODE = 70  # the process ends with this when another rank of its worker is gone
# The level a worker actor logs at (`pdserve --log-level LEVEL up` sets it for the job's actors):
# INFO shows what each engine runs on (attention backend, CUDA graphs, KV cache size) and more
# lines per request; unset, warnings and errors only.
WORKER_LOG_LEVEL_ENV = "PDSERVE_WORKER_LOG_LEVEL"


class TransferSignal:
    """Wakes coroutines on the actor's event loop when the transfer pump reports events."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def notify(self) -> None:
        """From any thread."""
        with self._lock:
            loop, event = self._loop, self._event
        if loop is not None and event is not None:
            loop.call_soon_threadsafe(event.set)

    def arm(self) -> asyncio.Event:
        """A cleared event that the next ``notify`` sets: arm, then check, then wait on it, so
        that no event between the check and the wait is missed."""
        with self._lock:
            if self._event is None:
                self._loop, self._event = asyncio.get_running_loop(), asyncio.Event()
            self._event.clear()
            return self._event


def configure_worker_logging() -> None:
    """Log at the level ``WORKER_LOG_LEVEL_ENV`` names, if it names one (first call wins)."""
    level = os.environ.get(WORKER_LOG_LEVEL_ENV)
    if level:
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@dataclass(slots=True)
class StepProfileBatch:
    """A worker's step log from some index on (``engine.step_profile``)."""

    role: str
    node: str  # workers on one node share its cores and memory bandwidth (contention, in the fit)
    num_steps: int  # recorded ever; pass back as ``since_step`` for only newer ones
    steps: list[tuple]  # in engine.step_profile.STEP_FIELDS order
    num_transfers: int
    transfers: list[TransferRecord]
    engine: dict[str, int | None]  # what the steps ran under: block size and count, budget, chunk, ...


class EngineWorker:
    """Base of the worker actors; ``role`` names the kind ("prefill", "decode")."""

    role = "worker"

    def __init__(self, worker_id: str, model_path: str, engine_config: EngineConfig, transfer_config: KVTransferConfig | None, scheduler_class,
                 adapter_files: dict[str, ray.ObjectRef] | None = None):
        configure_worker_logging()
        self.worker_id = worker_id
        self._thread = EngineThread(f"{self.role}-{worker_id}")
        self._thread.start()
        self.ranks = RayRankLauncher() if engine_config.tensor_parallel_size > 1 else None
        # A Hugging Face id is looked up in this node's own cache; a directory is used as is.
        model_path = str(resolve_model(model_path).path)
        # The LoRA adapters served here: what each name was loaded from (as named), and the files
        # of each version that came as files: a router that restarts adopts them from here
        # (router.lora_adapters), and hands the files to workers that join later.
        self._adapter_sources: dict[str, str] = dict(engine_config.lora_adapters)
        shipped: dict[str, AdapterFiles] = {}
        if adapter_files:
            # The configured LoRA adapters as the controller read them, written out on this node.
            shipped = dict(zip(adapter_files, ray.get(list(adapter_files.values()))))
            adapters = {name: str(shipped[name].on_node()) if name in shipped else path for name, path in engine_config.lora_adapters.items()}
            engine_config = dataclasses.replace(engine_config, lora_adapters=adapters)
        self.engine = self._thread.run(LLMEngine, model_path, engine_config, scheduler_class, self.ranks)
        self._adapter_files: dict[str, AdapterFiles] = {self.engine.adapters.names[name]: files for name, files in shipped.items()}  # by digest
        self.scheduler = self.engine.scheduler
        shard = self.engine.shard
        transfer_config = transfer_config or KVTransferConfig()
        self.agent = KVAgent(
            worker_id, self.engine.kv_cache.tensor, KVCompat(**self.engine.kv_compat_fields()), transfer_config,
            shard=KVShard(shard.tp_size, 0, shard.kv_head_start, shard.num_kv_heads),
            open_ranks=(lambda base: self.ranks.open_transports(base, transfer_config)) if self.ranks is not None else None,
            address=ray.util.get_node_ip_address(),
        )
        self.state = WorkerState.READY
        self.node = node_name()
        # Rank 0's node, then each other rank's (one node: the placement group packs them).
        self.rank_nodes = [self.node, *(self.ranks.nodes() if self.ranks is not None else [])]
        self._step_delay_s = 0.0
        self._stage_turn = False  # whether a pipeline stage's chunk goes before the worker's next step
        self._cache_log = CacheEventLog(worker_id)
        self.step_log = StepLog()  # what each step computed and how long the turn took (cluster/planning)
        self.transfer_events = TransferSignal()
        self.pump = TransferPump(self.agent, on_events=self._on_transfer_events)
        self.pump.start()
        self.activations = self._activation_channel(transfer_config)

    def _activation_channel(self, transfer_config: KVTransferConfig) -> ActivationChannel | None:
        """Where pipeline stages' activations go over NIXL (beside the KV); None: over Ray."""
        if transfer_config.backend != "nixl" or transfer_config.stage_inbox_slots < 1:
            return None
        try:
            return ActivationChannel(
                f"{self.agent.ref}/activations", self.engine.model_config.hidden_size, self.engine.dtype, self.engine.kv_cache.tensor.device,
                transfer_config.stage_slot_tokens, transfer_config.stage_inbox_slots, on_arrival=self._thread.wake,
            )
        except BackendUnavailableError as exc:
            logger.warning("%s: pipeline activations go over Ray (%s)", self.worker_id, exc)
            return None

    def _on_transfer_events(self) -> None:
        """The pump saw transfers complete, fail or arrive (its thread): wake whoever waits."""
        self._thread.wake()
        self.transfer_events.notify()

    def _run_engine(self) -> None:
        """Start turning the subclass's ``_iterate`` on the engine thread: one turn of work,
        True if it did something (else the thread sleeps until woken). A subclass calls this
        last in its constructor, once its own state exists."""
        self._thread.attach(self._turn)

    def _take_turns(self, run_step: Callable[[], bool]) -> bool:
        """Run a pipeline stage's chunk (``_run_stage_chunk``) or the worker's own step
        (``run_step``), taking turns: neither holds the other back by more than one step."""
        if self._stage_turn and self._run_stage_chunk():
            self._stage_turn = False
            return True
        if run_step():
            self._stage_turn = True
            return True
        return self._run_stage_chunk()

    def _run_stage_chunk(self) -> bool:
        """One chunk of a pipeline stage computed here, if one is ready (the roles' own)."""
        return False

    def _turn(self) -> bool:
        try:
            busy = self._iterate()
        except RankFailedError:
            # Another rank is gone and every step needs it: end this process now, so that Ray
            # reports the worker dead at once (its requests retried or migrated, the pool
            # replacing it) instead of failing requests one by one.
            logger.critical("%s %s: a tensor-parallel rank is lost; ending the worker", self.role, self.worker_id, exc_info=True)
            os._exit(RANK_LOST_EXIT_CODE)
        self._publish_cache_events()
        return busy

    def _publish_cache_events(self) -> None:
        """Engine thread: what the prefix cache did this turn, for the routers that follow it."""
        if self.engine.allocator.record_events:
            self._cache_log.append(self.engine.allocator.drain_events())

    def _pause_after_step(self) -> None:
        if self._step_delay_s:
            time.sleep(self._step_delay_s)

    async def _call(self, fn, *args):
        """Run ``fn`` on the engine thread (between steps) and wait for it."""
        return await asyncio.wrap_future(self._thread.call(fn, *args))

    async def _prepare_grammar(self, params) -> None:
        """A constrained request's tokenizer and grammar built on a thread of their own, before the
        engine thread takes the request (engine.grammar.Grammars.prepare): there they stalled
        every running stream. A grammar that does not compile raises here, as it would there."""
        if params.structured is not None:
            await asyncio.to_thread(self.engine.grammars.prepare, params.structured)

    # -- calls every worker answers -----------------------------------------------------

    async def ping(self, hang_timeout_s: float = 120.0) -> str:
        """The epoch, if the engine thread is alive and making progress (else RuntimeError)."""
        self._thread.check_healthy(hang_timeout_s)
        if self.ranks is not None:
            self.ranks.check_alive()
        if not self.pump.alive or self.pump.last_error is not None:
            raise RuntimeError(f"{self.role} worker {self.worker_id}: transfer pump failed: {self.pump.last_error!r}")
        return self.agent.ref.epoch

    async def rank_handles(self) -> list:
        """The actors of ranks 1..tp-1 (empty with one rank): for operations and fault drills."""
        return list(self.ranks.actors) if self.ranks is not None else []

    async def drain(self) -> None:
        """Take no new requests; the pool manager removes this worker once it is idle."""
        self.state = WorkerState.DRAINING

    async def set_step_delay(self, seconds: float) -> None:
        """Fault injection for tests and drills: sleep this long after every engine step."""
        self._step_delay_s = max(0.0, float(seconds))

    async def lora_adapters(self) -> dict[str, str]:
        """The LoRA adapters new requests may name here: name -> digest (engine.lora)."""
        return await self._call(lambda: self.engine.adapters.served)

    async def lora_adapter_versions(self) -> dict[str, tuple[str, str, AdapterFiles | None]]:
        """name -> (digest, what it was loaded from as named, its files where they came as files)
        of the adapters served here: what a router that starts over this worker adopts."""
        served = await self.lora_adapters()
        return {name: (digest, self._adapter_sources.get(name, ""), self._adapter_files.get(digest)) for name, digest in served.items()}

    async def load_lora_adapter(self, name: str, adapter: str | AdapterFiles, replace: bool = False) -> str:
        """Serve a PEFT LoRA adapter as ``name`` from now on (between steps); its digest.
        ``adapter``: its directory on this node, or its files as the router read them.
        ``replace``: a new version of a served one (the old stays held until dropped)."""
        if isinstance(adapter, AdapterFiles):
            with adapter.written() as directory:  # read by every rank before the load returns
                digest = await self._call(self.engine.load_adapter, name, str(directory), replace)
            self._adapter_files[digest] = adapter
            self._adapter_sources[name] = adapter.source
        else:
            digest = await self._call(self.engine.load_adapter, name, adapter, replace)
            self._adapter_sources[name] = adapter
        await self._forget_dropped_adapter_files()
        return digest

    async def unload_lora_adapter(self, name: str, keep_version: bool = False) -> bool:
        """No new requests through ``name``; running ones finish through it (``keep_version``:
        requests pinned to its version may still come, until ``drop_lora_version``). False if
        not served."""
        unloaded = await self._call(self.engine.unload_adapter, name, keep_version)
        self._adapter_sources.pop(name, None)
        await self._forget_dropped_adapter_files()
        return unloaded

    async def drop_lora_version(self, digest: str) -> bool:
        """No new request computes with this adapter version; freed once unused. False if not held."""
        dropped = await self._call(self.engine.drop_adapter_version, digest)
        await self._forget_dropped_adapter_files()
        return dropped

    async def _forget_dropped_adapter_files(self) -> None:
        served = set((await self.lora_adapters()).values())
        for digest in self._adapter_files.keys() - served:
            del self._adapter_files[digest]

    async def cache_events(self, cursor: int = -1, timeout_s: float = 1.0) -> CacheUpdate:
        """What the prefix cache stored and evicted after ``cursor`` (waiting up to ``timeout_s``
        for something), or, for a new follower (-1) or one the log no longer reaches, a snapshot
        of everything it holds."""
        update = await self._cache_log.wait_since(cursor, timeout_s)
        if update is None:
            update = await self._call(self._cache_snapshot)
        return update

    def _cache_snapshot(self) -> CacheUpdate:
        self.engine.allocator.record_events = True  # from now on someone follows
        self._publish_cache_events()
        return self._cache_log.snapshot(self.engine.allocator.cached_hashes())

    async def step_profile(self, since_step: int = 0, since_transfer: int = 0) -> StepProfileBatch:
        """Steps (and KV writes) recorded from those indexes on, for fitting a step-time model."""
        log = self.step_log
        engine, config = self.engine, self.engine.config
        facts = {
            "block_size": engine.kv_cache.block_size,
            "bytes_per_block": engine.kv_cache.bytes_per_block,
            "num_blocks": engine.kv_cache.num_blocks,
            "max_model_len": engine.max_model_len,
            "token_budget": config.max_num_batched_tokens,
            "chunk_size": config.long_prefill_chunk,
            "max_num_seqs": config.max_num_seqs,
            "tensor_parallel_size": config.tensor_parallel_size,  # bytes_per_block is one rank's share
            # What a pipelined prefill's stages cost (cluster/planning/simulator.py): each computes
            # its share of the layers and hands the next its hidden and residual rows per token.
            "num_layers": engine.model_config.num_layers,
            "activation_bytes_per_token": 2 * engine.model_config.hidden_size * engine.dtype.itemsize,
        }
        num_steps, steps, num_transfers, transfers = log.read(since_step, since_transfer)
        return StepProfileBatch(self.role, self.node, num_steps, steps, num_transfers, transfers, facts)

    async def shutdown(self) -> None:
        stopped = self._thread.stop()
        self.pump.stop()
        self.agent.close()
        if self.activations is not None:
            self.activations.close()
        if self.ranks is not None:
            if stopped:
                self.engine.close()  # tells the ranks to stop (a broadcast), then ends them
            else:
                # A step still runs its collectives on the engine thread: a STOP broadcast from
                # here would meet them in the middle (two threads on one group's sockets).
                logger.warning("%s %s: a step still runs at shutdown; its ranks are ended", self.role, self.worker_id)
                self.ranks.stop()
