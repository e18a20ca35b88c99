"""The in-process engine: add requests, call ``step()``, read each request's new tokens.

A request's life: ``add_request`` validates it and queues it in the scheduler; every
``step()`` schedules a packed batch (decode tokens plus prefill chunks under the token
budget), runs it through the model, samples the sequences whose prompts are complete and
returns one ``RequestOutput`` per sequence that got a token or finished. ``abort_request``
frees the request's blocks immediately.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.attention import CacheGeometry, select_backend
from engine.block_allocator import BlockAllocator, adapter_hash_salt, cache_hash_salt, prefix_lookup_hashes
from engine.cuda_graphs import DecodeGraphs
from engine.config import EngineConfig, ModelConfig
from engine.default_model_path import DEFAULT_MODEL_PATH
from engine.elastic_threads import ElasticThreads
from engine.errors import InvalidRequestError, ModelLoadError
from engine.executor import STOP, AdapterChange, Executor, LocalExecutor, MultiRankExecutor
from engine.grammar import Grammars, apply_masks
from engine.host_to_device import to_device
from engine.kernel_warm_up import warm_up_kernels
from engine.kv_cache import KVCache
from engine.loader import load_model, resolve_dtype, weights_digest
from engine.lora import AdapterTable
from engine.lora_loading import adapter_digest, adapter_rank
from engine.model import StageActivations
from engine.model_runner import ModelRunner
from engine.parallel.group import SINGLE, RankFailedError, TPGroup, listen
from engine.parallel.launch import RankLauncher, SubprocessRanks
from engine.parallel.shard import TPShard
from engine.sampler import LogprobTensors, Sampler, banned_tokens
from engine.sampling_params import SamplingParams
from engine.overlap import InFlightStep
from engine.scheduler import DrainFirst, ScheduledBatch, ScheduledSlice, Scheduler
from engine.sequence import FinishReason, Sequence, TokenLogprob
from engine.draft_model import DraftModelProposer, draft_bytes_per_block
from engine.speculation import DraftRow, NgramProposer, Proposer
from engine.step_profile import StepShape, shape_of

logger = logging.getLogger(__name__)

NO_ALLOWED_TOKEN = "holds no token that the requested structured output allows next"
NO_UNBANNED_TOKEN = "ban every token that the requested structured output allows next"
_NOTHING_LEFT = {"allowed_token_ids": NO_ALLOWED_TOKEN, "bad_words": NO_UNBANNED_TOKEN}
SCORED_LOGITS_BYTES = 256 * 1024 * 1024  # a step's prompt-scoring logits and their log-softmax, at most


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None  # why a request ended with FinishReason.ERROR
    # Where the client's own values made it impossible to go on (InvalidRequestError): the
    # field they are in, and ``error`` is the problem with it; None for the server's failures.
    error_field: str | None = None
    # On the output that carries a request's first tokens, where this engine computed its prompt
    # and the request asked (``SamplingParams.prompt_logprobs``): prompt token i + 1's at i.
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class Completion:
    """A finished request, as ``generate`` returns it."""

    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: FinishReason
    logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt token i + 1's at i


RANK_STOP_WAIT_S = 30.0  # how long a failed engine waits for its ranks to take its stop


def _tell_ranks_to_stop(group: TPGroup, launcher: RankLauncher) -> None:
    """Broadcast STOP to the ranks of an engine that failed after they loaded, bounded: a rank
    that died before it served (its own KV cache's allocation) would hold the broadcast for good
    (NCCL's first collective waits for every rank). The launcher's stop ends them either way."""
    try:
        getattr(launcher, "check_alive", lambda: None)()
    except Exception:
        return  # a rank is gone: no broadcast can complete
    sent = threading.Event()

    def send() -> None:
        with contextlib.suppress(Exception):
            group.broadcast_from_first(STOP)
        sent.set()

    threading.Thread(target=send, name="tell-ranks-to-stop", daemon=True).start()
    sent.wait(RANK_STOP_WAIT_S)


class LLMEngine:
    """One scheduler, one block manager and a sampler over an executor (one process, or the
    ranks of a tensor-parallel group whose rank 0 this is; ``rank_launcher`` starts the others,
    ``SubprocessRanks`` by default)."""

    def __init__(
        self,
        model_path: str | Path | None = None,
        config: EngineConfig | None = None,
        scheduler_cls=Scheduler,
        rank_launcher: RankLauncher | None = None,
    ):
        self.config = config or EngineConfig()
        self.config.validate()
        if self.config.num_threads is not None:
            torch.set_num_threads(self.config.num_threads)
        self.elastic_threads: ElasticThreads | None = None
        if self.config.max_num_threads is not None and self.config.device == "cpu" and self.config.tensor_parallel_size == 1:
            self.elastic_threads = ElasticThreads(self.config.num_threads or torch.get_num_threads(), self.config.max_num_threads, torch.set_num_threads)
        self.model_path = Path(model_path) if model_path is not None else DEFAULT_MODEL_PATH
        tp_size = self.config.tensor_parallel_size
        if not self.model_path.is_dir():
            raise ModelLoadError(f"model directory {self.model_path} does not exist")
        model_config = ModelConfig.from_model_dir(self.model_path)
        try:
            self.shard = TPShard.of(model_config, tp_size)
        except ValueError as exc:
            raise ModelLoadError(f"{self.model_path}: {exc}") from None
        # Every rank must agree on the block count: rank 0 settles it before any starts.
        cache_config = self._sized_cache_config(model_config)
        group: TPGroup = SINGLE
        self.rank_launcher = None
        if tp_size > 1:
            self.rank_launcher = rank_launcher or SubprocessRanks()
            address, store = listen(tp_size, self.config.device)
            self.rank_launcher.start(self.model_path, dataclasses.replace(cache_config, speculative=None), address)
        loaded = None
        try:
            if tp_size > 1:
                group = TPGroup.join(address, 0, store, check_ranks=getattr(self.rank_launcher, "check_alive", None))
            for name, adapter_dir in self.config.lora_adapters.items():
                if (problem := self._rank_problem(adapter_dir)) is not None:
                    raise ModelLoadError(f"lora_adapters.{name}: {problem}")
            # The rotary tables cover the engine's context (dynamic and LongRoPE schedules depend on it).
            loaded = load_model(
                self.model_path, dtype=self.config.dtype, device=self.config.device, max_positions=self.config.max_model_len,
                prepack_linear=self.config.prepack_linear, tp_size=tp_size, group=group, lora_adapters=self.config.lora_adapters,
            )
            self.model_config = loaded.config
            self.dtype = loaded.dtype
            self.eos_token_ids = loaded.eos_token_ids
            self.max_model_len = self._max_model_len()
            graphs_wanted = torch.device(self.config.device).type == "cuda" and self.config.cuda_graph_max_batch > 0 and tp_size == 1
            self.kv_cache = KVCache(loaded.config, cache_config, loaded.dtype, num_kv_heads=self.shard.num_kv_heads, scratch_block=graphs_wanted)
            self.allocator = BlockAllocator(self.kv_cache.num_blocks, self.config.enable_prefix_caching)
            attention = select_backend(
                self.config.attention_backend, CacheGeometry.of(loaded.config, self.kv_cache, loaded.dtype, self.config.device, self.shard.num_heads)
            )
            graphs = None
            if graphs_wanted and attention.supports_cuda_graphs:
                graphs = DecodeGraphs(
                    loaded.model, self.kv_cache, attention, min(self.config.cuda_graph_max_batch, self.config.max_num_seqs),
                    -(-self.max_model_len // self.kv_cache.block_size) + 1,
                )
                graphs.capture_all()
            # The LoRA adapters served (engine.lora): the configured ones in slots 0.., more at runtime.
            self.adapters = AdapterTable()
            for slot, (name, adapter_dir) in enumerate(self.config.lora_adapters.items()):
                digest = adapter_digest(adapter_dir)
                # The same adapter under two names: one version, computed from the first one's slot.
                self.adapters.add(name, digest, self.adapters.slots.get(digest, slot))
            self.runner = ModelRunner(loaded.model, self.kv_cache, self.config.device, attention, graphs, self.adapters)
            self.executor: Executor = MultiRankExecutor(self.runner, group) if tp_size > 1 else LocalExecutor(self.runner)
            self.sampler = Sampler(self.config.seed, self.eos_token_ids)
            self.grammars = Grammars(self.model_path, self.model_config.vocab_size, self.eos_token_ids)
            self.scheduler = scheduler_cls(self.config, self.allocator, self.max_model_len, self.eos_token_ids, proposer=self._proposer(loaded.dtype))
            # A scored prompt's rows of logits are bounded per step: 512 rows of a 152k vocabulary
            # would be 311 MB of float32 logits, and as much again for their log-softmax.
            self.scheduler.max_scored_rows = max(self.config.block_size, SCORED_LOGITS_BYTES // (self.model_config.vocab_size * 4 * 2))
            if torch.device(self.config.device).type == "cuda":
                # FlashInfer and Triton build kernels on first use, minutes on a fresh machine: now, not in the first requests.
                seconds = warm_up_kernels(self.executor, self.allocator, self.kv_cache, self.sampler, self.model_config.vocab_size, self.max_model_len)
                logger.info("kernels warmed up (a prefill, a decode step and each kind of draw) in %.1f s", seconds)
        except BaseException:
            if self.rank_launcher is not None:
                # The ranks it started would wait for rank 0 forever (a failure after the load
                # too: the KV cache's allocation, a draft model's load, the kernels' warm-up).
                if loaded is not None:  # they serve: told to stop, they end now, not killed after a wait
                    _tell_ranks_to_stop(group, self.rank_launcher)
                self.rank_launcher.stop()
            raise
        self.num_steps = 0
        self.num_scheduled_tokens = 0
        # Wall time inside step(): against a worker's wall time, whether its steps or the time
        # between them (its loop, its calls) set the pace of its tokens (router.metrics).
        self.step_seconds = 0.0
        self.last_shape: StepShape | None = None  # of the latest batch run_batch was given
        # Overlapped steps (engine.overlap): the step whose tokens are not read yet, and outputs
        # read outside a step (to abort, say), which the next step() returns.
        self._in_flight: InFlightStep | None = None
        self._undelivered: list[RequestOutput] = []
        # async_scheduling None: on where the device computes asynchronously (CUDA).
        overlap = self.config.async_scheduling if self.config.async_scheduling is not None else torch.device(self.config.device).type == "cuda"
        self._may_overlap = (
            overlap and self.scheduler.overlaps_steps and self.scheduler.proposer is None
            and self.scheduler.chunk_sizer is None and isinstance(self.executor, LocalExecutor)
        )
        # What a step runs on, said once: a served actor's pace differs by an order of magnitude
        # between FlashInfer with graphs and the portable SDPA path.
        logger.info(
            "engine ready: %s on %s (%s), %d KV blocks of %d tokens (%.1f MiB per rank), max_model_len %d, tensor parallel %d, "
            "attention %s, CUDA graphs %s, overlapped steps %s",
            self.model_config.architecture,
            self.config.device,
            loaded.dtype,
            self.kv_cache.num_blocks,
            self.kv_cache.block_size,
            self.kv_cache.num_blocks * self.kv_cache.bytes_per_block / 2**20,
            self.max_model_len,
            tp_size,
            attention.name,
            f"up to batch {graphs.buckets[-1]}" if graphs is not None else "off",
            "on" if self._may_overlap else "off",
        )

    def _sized_cache_config(self, model_config: ModelConfig) -> EngineConfig:
        """The config with ``num_kv_blocks`` settled: from ``kv_cache_bytes`` per rank (the bytes a
        block of this rank's KV heads takes, plus a draft model's share of the same block id)."""
        if self.config.num_kv_blocks is not None:
            return self.config
        config = self.config
        dtype = resolve_dtype(model_config, config.dtype, config.device)
        per_block = KVCache.bytes_per_block_of(model_config, config.block_size, dtype, config.kv_cache_dtype, self.shard.num_kv_heads)
        if config.speculative is not None and config.speculative.method == "draft_model":
            per_block += draft_bytes_per_block(config.speculative.draft_model, config, dtype)
        return dataclasses.replace(config, num_kv_blocks=max(1, config.kv_cache_bytes // per_block))

    def _proposer(self, dtype: torch.dtype) -> Proposer | None:
        """Where a decoding sequence's drafts come from (None: no speculation)."""
        spec = self.config.speculative
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec)
        return DraftModelProposer(spec.draft_model, self.config, self.kv_cache.num_blocks, self.model_config.vocab_size, dtype, self.eos_token_ids)

    def _max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        if self.config.max_model_len is not None:
            limit = min(limit, self.config.max_model_len)
        return limit

    # -- requests ---------------------------------------------------------------------

    def make_sequence(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0) -> Sequence:
        """Validate a request against this model and build its sequence (not yet queued)."""
        if req_id in self.scheduler.requests:
            raise InvalidRequestError("request_id", f"{req_id!r} is already running")
        if not prompt_token_ids:
            raise InvalidRequestError("prompt", "must contain at least one token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError("prompt_token_ids", f"token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"{len(prompt_token_ids)} tokens leave no room to generate within the model's context of "
                f"{self.max_model_len} tokens",
            )
        params.validate(vocab)
        digest = None if params.lora_name is None else self.adapters.resolve(params.lora_name, params.lora_digest)
        if params.lora_name is not None and digest is None:
            if params.lora_digest is not None:
                raise InvalidRequestError("lora_name", f"version {params.lora_digest[:12]} of LoRA adapter {params.lora_name!r} is not held here")
            served = ", ".join(self.adapters.served) or "none"
            raise InvalidRequestError("lora_name", f"no LoRA adapter named {params.lora_name!r} here (served: {served})")
        most_tokens = min(len(prompt_token_ids) + params.max_tokens, self.max_model_len)
        if self.kv_cache.blocks_needed(most_tokens) > self.kv_cache.num_blocks:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt plus max_tokens needs {self.kv_cache.blocks_needed(most_tokens)} KV blocks, "
                f"the cache has {self.kv_cache.num_blocks}",
            )
        # A resumed stream's prompt ends with the output it already produced.
        produced = prompt_token_ids[len(prompt_token_ids) - params.num_resumed_tokens :] if params.num_resumed_tokens else []
        thinking = params.thinking.state() if params.thinking is not None else None
        answer = [token_id for token_id in produced if thinking is None or thinking.accept(token_id)]
        grammar = self.grammars.for_sequence(params.structured, answer) if params.structured is not None else None
        seq = Sequence(
            req_id=req_id,
            token_ids=list(prompt_token_ids),
            num_prompt_tokens=len(prompt_token_ids),
            params=params,
            priority=priority,
            generator=Sampler.make_generator(params.seed),
            grammar=grammar,
            thinking=thinking,
            hash_salt=adapter_hash_salt(digest) + cache_hash_salt(params.cache_salt),
            adapter_slot=-1 if digest is None else self.adapters.slots[digest],
        )
        if grammar is not None and (field := self._field_leaving_nothing(seq)) is not None:
            # Refused before anything is computed, on every path a prompt takes (a pipeline
            # stage's too); later tokens are checked before each step (``_run_now``).
            raise InvalidRequestError(field, _NOTHING_LEFT[field])
        return seq

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """Prompt tokens of ``seq`` (not yet queued) this engine's prefix cache holds now."""
        if not self.allocator.enable_prefix_caching or seq.needs_prompt_logprobs:
            return 0
        hashes = prefix_lookup_hashes(seq.token_ids, self.kv_cache.block_size, seq.hash_salt)
        return self.allocator.num_cached_prefix(hashes) * self.kv_cache.block_size

    def add_request(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None, priority: int = 0) -> Sequence:
        seq = self.make_sequence(req_id, prompt_token_ids, params or SamplingParams(), priority)
        self.scheduler.add(seq)
        return seq

    def abort_request(self, req_id: str) -> bool:
        """Stop a request and free its blocks now; False if it was not here."""
        if req_id not in self.scheduler.requests:
            return False
        self._settle()
        if req_id not in self.scheduler.requests:
            return False  # the step in flight finished it (its output comes with the next step's)
        self.scheduler.abort(req_id)
        # Its tokens the step in flight sampled go to nobody: kept, they went out with the next
        # step's under its id, which a newer attempt of the request may hold by then (a decode
        # actor takes a given-up attempt's place at once), as that one's tokens.
        self._undelivered = [out for out in self._undelivered if out.req_id != req_id]
        self._release_adapters()
        logger.info("req %s: aborted", req_id)
        return True

    # -- LoRA adapters at runtime ------------------------------------------------------

    def load_adapter(self, name: str, adapter_dir: str, replace: bool = False) -> str:
        """Serve the PEFT LoRA adapter in ``adapter_dir`` as ``name`` from now on (every rank
        loads its slices); return its digest. ModelLoadError if it does not fit the model.
        ``replace``: a new version of a served ``name``; the previous one stays held (requests
        pinned to it keep working) until ``drop_adapter_version``."""
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("lora_name", f"must be a non-empty name, got {name!r}")
        if name in self.adapters.names and not replace:
            raise InvalidRequestError("lora_name", f"adapter {name!r} is already loaded (replace it with load_inplace)")
        digest = adapter_digest(adapter_dir)
        slot = self.adapters.slots.get(digest)  # this very version may be held already (even dropped: kept now)
        if slot is None:
            if (problem := self._rank_problem(adapter_dir)) is not None:
                raise InvalidRequestError("lora_path", problem)
            slot = self.adapters.free_slot()
            self.executor.change_adapter(AdapterChange(slot, str(adapter_dir)), self.dtype)
            logger.info("LoRA adapter %s (%s) loaded from %s into slot %d", name, digest[:12], adapter_dir, slot)
        self.adapters.add(name, digest, slot)
        self._release_adapters()
        return digest

    def _rank_problem(self, adapter_dir: str) -> str | None:
        """What is wrong with the adapter's rank (above max_lora_rank), or None."""
        max_rank = self.config.max_lora_rank
        if max_rank is not None and (rank := adapter_rank(adapter_dir)) > max_rank:
            return f"the adapter's rank {rank} is above max_lora_rank = {max_rank}"
        return None

    def unload_adapter(self, name: str, keep_version: bool = False) -> bool:
        """Take no new requests through ``name``; its version, unless another name serves it
        too, is freed when the last running request through it ends (``keep_version``: once
        ``drop_adapter_version`` says so). False if it was not served."""
        unloaded = self.adapters.forget(name, keep_version)
        self._release_adapters()
        return unloaded

    def drop_adapter_version(self, digest: str) -> bool:
        """No new request computes with this version (by any name); freed once unused. False
        if it is not held."""
        dropped = self.adapters.drop(digest)
        self._release_adapters()
        return dropped

    def _release_adapters(self) -> None:
        if not self.adapters.retiring:
            return
        in_use = {seq.adapter_slot for seq in self.scheduler.requests.values()}
        for slot in self.adapters.release(in_use):
            self.executor.change_adapter(AdapterChange(slot, None), self.dtype)
            logger.info("LoRA adapter slot %d freed", slot)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None or bool(self._undelivered)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def kv_compat_fields(self) -> dict[str, object]:
        """What a peer's KV cache must match for blocks to be copied between the two."""
        config_bytes = (self.model_path / "config.json").read_bytes()
        return {
            "model_id": f"{self.model_config.architecture}:{hashlib.sha256(config_bytes).hexdigest()[:16]}",
            "dtype": str(self.kv_cache.dtype).removeprefix("torch."),  # a quantized cache's element type
            "num_layers": self.model_config.num_layers,
            "num_kv_heads": self.model_config.num_kv_heads,
            "head_dim": self.model_config.head_dim,
            "block_size": self.kv_cache.block_size,
            "block_scales": self.kv_cache.quantized is not None,
            "weights": weights_digest(self.model_path),
            "rope": self.runner.model.rotary.schedule_digest,
        }

    # -- stepping ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and run a step; the outputs of the requests that got tokens or finished (with
        overlapped steps, those of the step before, read while this one computes)."""
        started = time.perf_counter()
        try:
            return self._step()
        finally:
            self.step_seconds += time.perf_counter() - started
            self._release_adapters()

    def _step(self) -> list[RequestOutput]:
        outputs, self._undelivered = self._undelivered, []
        try:
            batch = self.scheduler.schedule()
        except DrainFirst:
            outputs += self.resolve_in_flight()
            batch = self.scheduler.schedule()
        if not batch.slices:
            return outputs + self.resolve_in_flight()
        return outputs + self._run_batch(batch)

    def run_batch(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Run one scheduled batch: overlapped where it can be (engine.overlap), else at once,
        after the step in flight (if any) has been read. Counted in ``step_seconds`` (a prefill
        worker runs its batches here, not through ``step``)."""
        started = time.perf_counter()
        try:
            return self._run_batch(batch)
        finally:
            self.step_seconds += time.perf_counter() - started
            self._release_adapters()

    def _run_batch(self, batch: ScheduledBatch) -> list[RequestOutput]:
        if self._may_overlap and self._overlaps(batch):
            return self._run_overlapped(batch)
        return self._run_after_in_flight(batch)

    def _run_after_in_flight(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Read the step in flight (if any), then run ``batch`` at once."""
        if self._in_flight is None:
            return self._run_now(batch)
        outputs = self.resolve_in_flight()
        # A sequence the step in flight ended (a stop token) leaves the batch.
        batch = ScheduledBatch([piece for piece in batch.slices if not piece.seq.is_finished], batch.preempted_req_ids)
        return outputs + (self._run_now(batch) if batch.slices else [])

    def resolve_in_flight(self) -> list[RequestOutput]:
        """Read the step in flight, if any, and advance its sequences: nothing stays in flight."""
        step, self._in_flight = self._in_flight, None
        self.scheduler.in_flight = set()
        return [] if step is None else self._resolve(step)

    def _overlaps(self, batch: ScheduledBatch) -> bool:
        device = torch.device(self.config.device)
        if batch.scores_prompt:
            return False  # its prompt rows are read at once (_record_prompt_logprobs)
        return all(self.sampler.draws_on_device(piece.seq, device) for piece in batch.slices if piece.completes_sequence)

    def _run_overlapped(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Launch ``batch`` with its tokens sampled on the device, then read the step before."""
        previous = self._in_flight
        self.runner.pending = previous.samples if previous is not None else None
        sampled = [piece.seq for piece in batch.slices if piece.completes_sequence]
        try:
            if self.elastic_threads is not None:
                self.elastic_threads.before_step()
            token_ids, logprobs = self.sampler.sample_on_device(self.executor.execute(batch), sampled, self.runner.pending)
        except RankFailedError:
            raise
        except Exception:
            # Never launched: run it at once instead, which isolates a request that fails it.
            logger.exception("an overlapped step of %d sequences failed; running it at once", len(batch.slices))
            self.runner.pending = None
            return self._run_after_in_flight(batch)
        finally:
            self.runner.pending = None
        self.num_steps += 1
        self.num_scheduled_tokens += batch.num_tokens
        self.last_shape = shape_of(batch)  # computed before launched() advances the sequences
        done = self.scheduler.launched(batch)
        self._in_flight = InFlightStep.launch(batch, done, token_ids, logprobs, sampled)
        self.scheduler.in_flight = self._in_flight.sequence_ids  # what ends now is freed after it
        return [] if previous is None else self._resolve(previous)

    def _resolve(self, step: InFlightStep) -> list[RequestOutput]:
        samples = step.read()
        self.scheduler.release_deferred()  # what ended while this step was in flight: it is done
        return self._request_outputs(self.scheduler.resolve(step.batch, step.done, samples))

    def _settle(self) -> None:
        """Read the step in flight before touching sequences outside a step; its outputs go out
        with the next ``step()``."""
        if self._in_flight is not None:
            self._undelivered += self.resolve_in_flight()

    def _run_now(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """``_run_checked`` for the batch's sequences that can draw a token at all: one whose
        allowed_token_ids (or bad_words) leave its grammar no next token leaves it first, ended
        as the client's error naming the field (checked before the forward, on the rare sequence with
        both: the rest of the batch runs once, as it would without it)."""
        refused = [
            (piece.seq, field) for piece in batch.slices
            if piece.num_sampled_rows and piece.seq.grammar is not None
            and (field := self._field_leaving_nothing(piece.seq)) is not None
        ]
        if not refused:
            return self._run_checked(batch)
        outputs = [self._fail(seq, InvalidRequestError(field, _NOTHING_LEFT[field])) for seq, field in refused]
        gone = {seq.req_id for seq, _ in refused}
        kept = ScheduledBatch([piece for piece in batch.slices if piece.seq.req_id not in gone], batch.preempted_req_ids)
        return outputs + (self._run_checked(kept) if kept.slices else [])

    def _field_leaving_nothing(self, seq: Sequence) -> str | None:
        """The field (allowed_token_ids, bad_words) whose values leave the grammar of ``seq`` no
        next token to draw, or None. (Drawn anyway, the row is all -inf: a token the grammar
        forbids, reported as a normal end.)"""
        allowed, banned = seq.params.allowed_token_ids, banned_tokens(seq)
        if (allowed is None and not banned) or self.grammars.allows_any(seq.grammar, seq.thinking, allowed, banned):
            return None  # (one mask, on the per-step path; a second only to name a refusal's field)
        if allowed is not None and not self.grammars.allows_any(seq.grammar, seq.thinking, allowed):
            return "allowed_token_ids"
        return "bad_words"

    def _run_checked(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Forward, sample and advance one scheduled batch.

        If computing the batch raises, each of its sequences is run again on its own, and only
        those that raise alone end, with FinishReason.ERROR and their blocks freed: one
        request's values (or a bug they reach) never take the engine or its other requests
        down. Running a sequence again is safe: nothing advanced, and rewriting its KV slots
        writes the same values. A lost rank (``RankFailedError``) is the worker's failure, not
        the batch's: it propagates, and no request is failed for it.
        """
        self.num_steps += 1
        self.num_scheduled_tokens += batch.num_tokens
        self.last_shape = shape_of(batch)  # what this step computes: the workers' step log, the chunk sizer
        if self.elastic_threads is not None:
            self.elastic_threads.before_step()
        sizer = self.scheduler.chunk_sizer
        try:
            if sizer is None:
                return self._compute(batch)
            started = time.perf_counter()
            outputs = self._compute(batch)
            sizer.observe(self.last_shape, time.perf_counter() - started)
            return outputs
        except RankFailedError:
            raise  # the worker is lost, not the batch: its requests are retried elsewhere
        except Exception as exc:
            if len(batch.slices) == 1:
                return [self._fail(batch.slices[0].seq, exc)]
            logger.exception("a batch of %d sequences failed; running each alone", len(batch.slices))
        outputs = []
        for piece in batch.slices:
            try:
                outputs.extend(self._compute(ScheduledBatch([piece])))
            except RankFailedError:
                raise
            except Exception as exc:
                outputs.append(self._fail(piece.seq, exc))
        return outputs

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (nothing to do with one rank)."""
        self.grammars.close()
        self.executor.close()
        if self.rank_launcher is not None:
            self.rank_launcher.stop()

    def _fail(self, seq: Sequence, exc: Exception) -> RequestOutput:
        """End a sequence whose computation raised ``exc``; its blocks are freed. An
        InvalidRequestError is the client's (values that leave nothing to compute): it names
        the field, for the router to answer as a bad request."""
        self.scheduler.abort(seq.req_id, FinishReason.ERROR)
        output = RequestOutput(
            req_id=seq.req_id,
            new_token_ids=[],
            finished=True,
            finish_reason=FinishReason.ERROR,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
        )
        if isinstance(exc, InvalidRequestError):
            logger.info("req %s: ends, its %s", seq.req_id, exc)
            output.error, output.error_field = exc.problem, exc.field
        else:
            logger.error("req %s: computing it failed; it alone ends", seq.req_id, exc_info=exc)
            output.error = f"computing this request failed: {type(exc).__name__}: {exc}"
        return output

    def run_stage(self, batch: ScheduledBatch, layers: range, incoming: StageActivations | None) -> StageActivations | list[RequestOutput]:
        """A pipeline stage's step over a batch of stage sequences (``PrefillScheduler.add_stage``):
        layers ``layers`` only, from the previous stage's ``incoming`` (None: this stage embeds).
        A stage before the last returns its activations for the next; the last samples and
        returns the outputs, as ``run_batch`` does. Their KV is written for those layers only."""
        self._settle()
        self.num_steps += 1
        self.num_scheduled_tokens += batch.num_tokens
        self.last_shape = shape_of(batch)
        last = layers.stop == self.model_config.num_layers
        masks = self.grammars.start_masks(_grammar_rows(batch)) if last else None
        out = self.executor.execute_stage(batch, layers, incoming)
        if not last:
            for piece in batch.slices:
                self.scheduler.advance_stage(piece.seq, piece.num_tokens)
            return out
        return self._outputs(out, batch, masks)

    def run_reserved_stage(
        self, seq: Sequence, num_tokens: int, layers: range, incoming: StageActivations
    ) -> tuple[int, TokenLogprob | None] | None:
        """The last stage of a pipelined prompt, computed where its KV is reserved (a decode
        actor whose reservation the earlier stages write their layers into): layers ``layers``
        of the prompt's next ``num_tokens`` from the previous stage's ``incoming``, their KV into
        the reservation's blocks. The sequence stays outside the batch and its blocks' hashes
        unpublished: until the other stages' layers landed, no other prompt may take them from
        the prefix cache (``Scheduler.admit_remote`` publishes them and admits the sequence).
        The chunk that ends the prompt returns the first token, which it does not append."""
        self._settle()
        batch = ScheduledBatch([ScheduledSlice(seq, num_tokens)])
        self.num_steps += 1
        self.num_scheduled_tokens += num_tokens
        self.last_shape = shape_of(batch)
        masks = self.grammars.start_masks(_grammar_rows(batch))
        logits = self.executor.execute_stage(batch, layers, incoming)
        sample = self._sample(logits, batch, masks)[0][0] if batch.slices[0].completes_sequence else None
        seq.num_computed_tokens += num_tokens
        return sample

    def _compute(self, batch: ScheduledBatch) -> list[RequestOutput]:
        masks = self.grammars.start_masks(_grammar_rows(batch))  # beside the forward
        return self._outputs(self.executor.execute(batch), batch, masks)

    def _outputs(self, logits: torch.Tensor, batch: ScheduledBatch, masks: Future | None) -> list[RequestOutput]:
        """Sample the batch's logits and advance its sequences."""
        samples = self._sample(logits, batch, masks)
        return self._request_outputs(self.scheduler.update(batch, samples))

    @staticmethod
    def _request_outputs(results: list[tuple[Sequence, list[int]]]) -> list[RequestOutput]:
        return [
            RequestOutput(
                req_id=seq.req_id,
                new_token_ids=new_tokens,
                new_logprobs=seq.output_logprobs[-len(new_tokens) :] if seq.params.logprobs is not None else [],
                finished=seq.is_finished,
                finish_reason=seq.finish_reason,
                num_prompt_tokens=seq.num_prompt_tokens,
                num_output_tokens=seq.num_output_tokens,
                prompt_logprobs=seq.prompt_logprobs if seq.prompt_logprobs and 0 < len(new_tokens) == seq.num_output_tokens else None,
            )
            for seq, new_tokens in results
        ]

    def _sample(self, logits: torch.Tensor, batch: ScheduledBatch, masks: Future | None) -> list[list[tuple[int, TokenLogprob | None]]]:
        """Per completing slice, the tokens it emits: its one sampled token, or with drafts, the
        row-by-row tokens while each equals the draft it verifies, and the first that does not
        (or the token after the last draft). Constrained rows are drawn under their grammar's
        mask (``masks``: computed while the forward ran; None: no row is constrained)."""
        logits = self._record_prompt_logprobs(logits, batch)
        completing = [piece for piece in batch.slices if piece.num_sampled_rows]
        if not completing:
            return []
        if masks is not None:
            logits = apply_masks(logits, masks.result())
        if not any(piece.draft_token_ids for piece in completing):
            return [[sample] for sample in self.sampler.sample(logits, [piece.seq for piece in completing])]
        rows: list[Sequence | DraftRow] = []
        row_drafts: list[int | None] = []
        row_probs: list[torch.Tensor | None] = []
        for piece in completing:
            drafts = piece.draft_token_ids
            rows.append(piece.seq)
            rows.extend(DraftRow(piece.seq, drafts[:i]) for i in range(1, len(drafts) + 1))
            row_drafts.extend(drafts)
            row_drafts.append(None)  # the row after the last draft: the target's own token
            row_probs.extend(piece.draft_probs or [None] * len(drafts))
            row_probs.append(None)
        samples = self.sampler.sample(logits, rows, row_drafts, row_probs)
        emitted = []
        cursor = 0
        for piece in completing:
            drafts = piece.draft_token_ids
            accepted = 0
            while accepted < len(drafts) and samples[cursor + accepted][0] == drafts[accepted]:
                accepted += 1
            emitted.append(samples[cursor : cursor + accepted + 1])
            cursor += piece.num_sampled_rows
        return emitted

    def _record_prompt_logprobs(self, logits: torch.Tensor, batch: ScheduledBatch) -> torch.Tensor:
        """The batch's sampled rows of ``logits``. The rows after them score the prompt tokens
        whose log-probabilities are asked for (``ModelRunner.prepare`` put them there): each
        sequence gets its own (``Sequence.prompt_logprobs``), computed beside the logits."""
        num_sampled = sum(piece.num_sampled_rows for piece in batch.slices)
        if logits.shape[0] == num_sampled:
            return logits
        owners: list[Sequence] = []
        targets: list[int] = []
        num_top: list[int] = []
        for piece in batch.slices:
            seq = piece.seq
            for position in seq.prompt_logprob_positions(seq.num_computed_tokens, piece.num_own_tokens):
                owners.append(seq)
                targets.append(seq.token_ids[position + 1])
                num_top.append(seq.params.prompt_logprobs)
        prompt_logits = logits[num_sampled:]
        assert prompt_logits.shape[0] == len(targets), (prompt_logits.shape, len(targets))
        reported = LogprobTensors.of_rows(prompt_logits, list(range(len(targets))), num_top, to_device(targets, torch.long, logits.device))
        for seq, entry in zip(owners, LogprobTensors.by_row(reported, targets)):
            seq.prompt_logprobs.append(entry)
        return logits[:num_sampled]

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Run prompts to completion together; results in prompt order."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        seqs = [
            self.add_request(f"generate-{id(self)}-{i}", prompt, SamplingParams(**_fields(p)))
            for i, (prompt, p) in enumerate(zip(prompts, params_list))
        ]
        while self.has_unfinished_requests():
            self.step()
        return [
            Completion(s.req_id, s.token_ids[: s.num_prompt_tokens], s.output_token_ids, s.finish_reason, s.output_logprobs, s.prompt_logprobs)
            for s in seqs
        ]


def _grammar_rows(batch: ScheduledBatch) -> list:
    """Per row ``_sample`` draws, the sequence's grammar (None: unconstrained) and the drafts
    before that row; empty when no row is constrained (most steps)."""
    completing = [piece for piece in batch.slices if piece.num_sampled_rows]
    if all(piece.seq.grammar is None for piece in completing):
        return []
    rows = []
    for piece in completing:
        drafts = piece.draft_token_ids or []
        rows.extend((piece.seq.grammar, piece.seq.thinking, drafts[:i]) for i in range(len(drafts) + 1))
    return rows


def _fields(params: SamplingParams) -> dict:
    # A private copy per request: callers may share one SamplingParams across prompts.
    return {name: getattr(params, name) for name in SamplingParams.__dataclass_fields__}
