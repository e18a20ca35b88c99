"""Tensor parallelism in the engine: a worker's model split over two gloo ranks computes what
one rank (and transformers) computes, for every architecture and its distinctive features."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import subprocess
import sys
import textwrap

import pytest

from engine import EngineConfig, FinishReason, LLMEngine, SamplingParams
from engine.errors import ModelLoadError
from engine.parallel.group import RankFailedError
from engine.parallel.launch import SubprocessRanks
from tests.checkpoints import build_checkpoint, hf_greedy, random_prompts

# Each architecture with what makes it different, at shapes that stress the split: biases on the
# row-parallel layers (added once), a vocabulary that does not divide by 2, a sliding window
# shorter than the prompts, a single KV head replicated on both ranks, per-head QK norms.
VARIANTS = {
    "llama": dict(attention_bias=True, mlp_bias=True, vocab_size=383),
    "mistral": dict(sliding_window=8),
    "qwen2": dict(num_key_value_heads=1),
    "qwen3": dict(attention_bias=True),
}
PROMPT_LENGTHS = [3, 19, 40]
MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=4)


@pytest.fixture(scope="module")
def tp_checkpoints(tmp_path_factory):
    built = {}
    for arch, overrides in VARIANTS.items():
        path = tmp_path_factory.mktemp(f"tp_{arch}")
        built[arch] = (path, build_checkpoint(arch, path, **overrides))
    return built


def _engine(path, tp: int, rank_launcher=None, **kwargs) -> LLMEngine:
    config = EngineConfig(num_kv_blocks=128, max_num_batched_tokens=64, long_prefill_chunk=16, num_threads=1, tensor_parallel_size=tp, **kwargs)
    return LLMEngine(path, config, rank_launcher=rank_launcher)


@pytest.mark.parametrize("arch", list(VARIANTS))
def test_two_ranks_match_one_rank_and_transformers(tp_checkpoints, arch):
    path, model = tp_checkpoints[arch]
    prompts = random_prompts(PROMPT_LENGTHS, model.config.vocab_size, seed=3)
    params = dataclasses.replace(GREEDY, prompt_logprobs=2)  # the prompt's rows come through the gathered logits too
    single = _engine(path, 1).generate(prompts, params)
    engine = _engine(path, 2)
    try:
        assert engine.executor.tp_size == 2
        split = engine.generate(prompts, params)
        assert engine.num_free_blocks == engine.kv_cache.num_blocks
    finally:
        engine.close()
    for prompt, one, two in zip(prompts, single, split):
        assert two.token_ids == hf_greedy(model, prompt, MAX_NEW), f"{arch}: TP 2 greedy differs from transformers"
        assert two.token_ids == one.token_ids
        assert len(two.prompt_logprobs) == len(one.prompt_logprobs) == len(prompt) - 1
        for a, b in zip(one.logprobs + one.prompt_logprobs, two.logprobs + two.prompt_logprobs):
            # The split sums partial products in another order: float32 rounding, no more.
            assert abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top)) < 1e-4


def test_rank_shards_hold_their_heads_and_vocabulary(tp_checkpoints):
    path, model = tp_checkpoints["qwen2"]  # one KV head, replicated
    engine = _engine(path, 2)
    try:
        shard = engine.shard
        assert (shard.num_heads, shard.num_kv_heads, shard.kv_head_start) == (2, 1, 0)
        assert engine.kv_cache.num_kv_heads == 1
        layer = engine.runner.model.layers[0]
        head_dim = model.config.hidden_size // model.config.num_attention_heads
        assert layer.qkv_proj.out_features == (2 + 2 * 1) * head_dim
        assert layer.gate_up_proj.out_features == model.config.intermediate_size  # half of gate|up
        assert engine.runner.model.embed_tokens.weight.shape[0] == model.config.vocab_size // 2
    finally:
        engine.close()


def test_quantized_cache_prefix_hits_and_speculation_under_two_ranks(tp_checkpoints):
    from engine.speculation import SpeculativeConfig

    path, model = tp_checkpoints["llama"]
    base = random_prompts([24], model.config.vocab_size, seed=5)[0]
    prompts = [base + [7, 8, 9] * 3, base + [11, 12]]  # a shared 24-token prefix: a cache hit
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    # The draft model runs whole on rank 0 (here the target's own checkpoint: every guess right).
    draft = SpeculativeConfig(method="draft_model", num_speculative_tokens=3, draft_model=str(path))
    plain = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    for kwargs in (dict(kv_cache_dtype="int8"), dict(speculative=ngram), dict(speculative=draft)):
        one = _engine(path, 1, **kwargs)
        expected = [one.generate([p], plain)[0].token_ids for p in prompts]
        engine = _engine(path, 2, **kwargs)
        try:
            got = [engine.generate([p], plain)[0].token_ids for p in prompts]
            assert engine.scheduler.requests == {}
            assert engine.num_free_blocks == engine.kv_cache.num_blocks
        finally:
            engine.close()
        assert got == expected, kwargs
        if "speculative" in kwargs:
            assert got == [hf_greedy(model, p, MAX_NEW) for p in prompts]


def test_heads_that_do_not_divide_are_refused_naming_both_numbers(tp_checkpoints):
    path, _ = tp_checkpoints["llama"]  # 4 attention heads
    with pytest.raises(ModelLoadError, match="tensor_parallel_size 3 does not divide the model's 4 attention heads"):
        _engine(path, 3)


_MEASURE = textwrap.dedent(
    """
    import json, sys, threading, time
    import torch
    from engine.loader import load_model
    from engine.parallel.group import TPGroup

    def rss_kb():
        with open("/proc/self/status") as status:
            # Anonymous memory: the weights read (pread, no mapping); not the library code pages
            # the first load faults in.
            return next(int(line.split()[1]) for line in status if line.startswith("RssAnon"))

    path, tp, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    # What loading touches besides the weights (the kernel library, dtype probes), before the base.
    from engine import native_kernels
    from engine.config import ModelConfig
    from engine.loader import resolve_dtype
    native_kernels.kernel()
    resolve_dtype(ModelConfig.from_model_dir(path), "float32")
    base = peak = rss_kb()
    done = False
    def sample():
        global peak
        while not done:
            peak = max(peak, rss_kb())
            time.sleep(0.0005)
    sampler = threading.Thread(target=sample)
    sampler.start()
    loaded = load_model(path, dtype="float32", tp_size=tp, group=TPGroup(rank, tp))
    done = True
    sampler.join()
    peak = max(peak, rss_kb())
    held = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    print(json.dumps({"peak_bytes": (peak - base) * 1024, "held_bytes": held}))
    """
)


def test_a_rank_loads_about_half_the_weights_at_tp_2(tmp_path):
    """Each rank reads only its slices from the files: its peak memory while loading is about
    half the weights below a whole load's (anonymous memory sampled during the load; both carry
    the same fixed ~70 MB of allocator and runtime overhead, measured, so the bound is on the
    difference)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    weights = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))

    # The three loads run at once, each in its own process: each samples its own memory.
    runs = {(tp, rank): subprocess.Popen([sys.executable, "-c", _MEASURE, str(tmp_path), str(tp), str(rank)], stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True) for tp, rank in ((1, 0), (2, 0), (2, 1))}

    def measure(tp: int, rank: int) -> dict:
        stdout, stderr = runs[tp, rank].communicate(timeout=300)
        assert runs[tp, rank].returncode == 0, stderr[-2000:]
        return json.loads(stdout.strip().splitlines()[-1])

    whole = measure(1, 0)
    assert whole["peak_bytes"] > 0.95 * weights  # the measurement sees a whole model's weights
    for rank in (0, 1):
        part = measure(2, rank)
        assert part["held_bytes"] < 0.55 * weights
        saved = whole["peak_bytes"] - part["peak_bytes"]
        assert saved > 0.4 * weights, (rank, part["peak_bytes"] / weights, whole["peak_bytes"] / weights)


def _fail_before_joining() -> None:
    raise SystemExit(3)  # as a rank whose device or import failed, before it reached the group


def test_a_rank_that_fails_before_joining_fails_rank_0_at_once_naming_it(tp_checkpoints):
    """Rank 0 joined the group and waited its timeout (days; a worker's start timed out after
    300 s, saying nothing of why) for a rank that never came; it now asks its launcher while it
    waits, and fails with that rank's end."""
    import multiprocessing
    import time

    from engine.parallel.launch import SubprocessRanks

    class FailingRanks(SubprocessRanks):
        def start(self, model_path, config, address):
            process = multiprocessing.get_context("spawn").Process(target=_fail_before_joining, daemon=True)
            process.start()
            self.processes.append(process)

    path, _ = tp_checkpoints["llama"]
    config = EngineConfig(num_kv_blocks=128, num_threads=1, tensor_parallel_size=2)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1 exited with code 3"):
        LLMEngine(path, config, rank_launcher=FailingRanks())
    assert time.monotonic() - started < 60


POISON_LENGTH = 13  # a prompt this long is one slice from position 0 (the others' first chunks are 16)


def _poisoned(step) -> bool:
    return any(piece.context_len == 0 and piece.num_tokens == POISON_LENGTH for piece in step.slices)


def _serve_rank_failing_on_poison(model_path, config, address, rank) -> None:
    from engine.parallel.rank import ShardRank

    shard_rank = ShardRank(model_path, config, address, rank)
    real_run = shard_rank.runner.run

    def run(step):
        if _poisoned(step):
            raise RuntimeError(f"injected fault on rank {rank}")
        return real_run(step)

    shard_rank.runner.run = run
    shard_rank.serve()


class PoisonedRanks(SubprocessRanks):
    """Ranks (1..) whose steps raise where they hold the poisoned prompt."""

    def start(self, model_path, config, address):
        for rank in range(1, address.world_size):
            process = multiprocessing.get_context("spawn").Process(
                target=_serve_rank_failing_on_poison, args=(model_path, config, address, rank), daemon=True,
            )
            process.start()
            self.processes.append(process)


def _poison_rank_0(engine, monkeypatch) -> None:
    real_run = engine.runner.run

    def run(step):
        if _poisoned(step):
            raise RuntimeError("injected fault on rank 0")
        return real_run(step)

    monkeypatch.setattr(engine.runner, "run", run)


def _requests(model):
    prompts = random_prompts([40, POISON_LENGTH, 19], model.config.vocab_size, seed=11)
    return {"good-0": prompts[0], "poison": prompts[1], "good-1": prompts[2]}


def test_a_step_every_rank_fails_alike_ends_only_its_request(tp_checkpoints, monkeypatch):
    """An error every rank meets with the same inputs (a request's own) keeps the ranks in step:
    that request ends with ERROR, the others go on as transformers computes, nothing leaks."""
    path, model = tp_checkpoints["llama"]
    engine = _engine(path, 2, rank_launcher=PoisonedRanks())
    try:
        _poison_rank_0(engine, monkeypatch)
        _only_the_poisoned_request_fails(engine, model, "injected fault on rank 0")
    finally:
        engine.close()


def _only_the_poisoned_request_fails(engine: LLMEngine, model, error: str) -> None:
    """Serve the three requests: the poisoned one ends with ``error``, the others as
    transformers computes them, and every block comes back."""
    requests = _requests(model)
    for req_id, prompt in requests.items():
        engine.add_request(req_id, prompt, GREEDY)
    outputs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.req_id, []).append(out)
    assert outputs["poison"][-1].finish_reason is FinishReason.ERROR and error in outputs["poison"][-1].error
    for req_id in ("good-0", "good-1"):
        assert [t for o in outputs[req_id] for t in o.new_token_ids] == hf_greedy(model, requests[req_id], MAX_NEW)
    assert engine.num_free_blocks == 128


def test_rank_0_failing_after_the_gather_ends_only_the_request(tp_checkpoints, monkeypatch):
    """Past the logits' gather every other rank is done with the step: rank 0's own work after it
    (joining the vocabulary shards, an out-of-memory error there) failing is no rank out of step.
    It ended the worker (and each retry of the request the next); it fails that request only."""
    path, model = tp_checkpoints["llama"]
    engine = _engine(path, 2)
    try:
        real_run = engine.runner.run

        def run(step):
            logits = real_run(step)  # the whole step, its gather included
            if _poisoned(step):
                raise RuntimeError("injected fault on rank 0 after the gather")
            return logits

        monkeypatch.setattr(engine.runner, "run", run)
        _only_the_poisoned_request_fails(engine, model, "after the gather")
    finally:
        engine.close()


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_step_that_fails_on_one_rank_alone_ends_the_worker_within_seconds(tp_checkpoints, monkeypatch, failing_rank):
    """A step that raises on one rank only (an out-of-memory error there, say) leaves the others
    waiting in its next collective. They waited for the shared memory's 60 s (a GPU's NCCL: the
    group's timeout of days) while requests stalled; now the failing rank learns within seconds
    that the others did not fail alike, aborts the group, and both ranks end with
    RankFailedError: the worker is replaced and its requests retried elsewhere."""
    import time

    path, model = tp_checkpoints["llama"]
    launcher = PoisonedRanks() if failing_rank == 1 else SubprocessRanks()
    engine = _engine(path, 2, rank_launcher=launcher)
    try:
        if failing_rank == 0:
            _poison_rank_0(engine, monkeypatch)
        for req_id, prompt in _requests(model).items():
            engine.add_request(req_id, prompt, GREEDY)
        started = time.monotonic()
        with pytest.raises(RankFailedError):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - started < 30
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the other rank stopped waiting too
            try:
                launcher.check_alive()
            except RuntimeError as exc:
                assert "rank 1 exited" in str(exc)
                break
            time.sleep(0.1)
        else:
            pytest.fail("rank 1 still waits in a collective")
    finally:
        engine.close()  # nothing left to stop: a broken group is already left


def test_an_engine_failing_after_its_ranks_loaded_ends_them(tp_checkpoints, monkeypatch):
    """Rank 0 fails after the model's load (here its draft model's; its KV cache's allocation or
    the kernels' warm-up alike): the ranks it started were left waiting for its broadcasts (for
    days) and held their memory as long as the process lived. Now they are ended."""
    from engine.parallel.launch import SubprocessRanks

    def no_draft(self, dtype):
        raise RuntimeError("the draft model cannot be read")

    monkeypatch.setattr(LLMEngine, "_proposer", no_draft)
    started = []

    class Ranks(SubprocessRanks):
        def start(self, model_path, config, address):
            super().start(model_path, config, address)
            started.extend(self.processes)

    path, _ = tp_checkpoints["llama"]
    with pytest.raises(RuntimeError, match="draft model"):
        LLMEngine(path, EngineConfig(num_kv_blocks=128, num_threads=1, tensor_parallel_size=2), rank_launcher=Ranks())
    assert started and not any(process.is_alive() for process in started)
    assert all(process.exitcode == 0 for process in started)  # stopped as told, not killed
