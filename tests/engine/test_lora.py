"""LoRA adapters in the engine: requests through different adapters (and none) share a batch,
and each computes what PEFT's own model of base plus that adapter computes."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import InvalidRequestError, ModelLoadError
from engine.stats import engine_stats
from tests.checkpoints import ARCHITECTURES, build_checkpoint, build_lora_adapter, hf_greedy, random_prompts

MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """arch -> (base dir, base model, {adapter name: (dir, PEFT model)}): one adapter on every
    projection, one on q and v only with rsLoRA scaling and its own rank and alpha per module."""
    built = {}
    for arch in ARCHITECTURES:
        root = tmp_path_factory.mktemp(f"lora_{arch}")
        model = build_checkpoint(arch, root / "base")
        adapters = {
            "every": (root / "every", build_lora_adapter(model, root / "every", seed=1)),
            "qv": (
                root / "qv",
                build_lora_adapter(
                    model, root / "qv", seed=2, targets=("q_proj", "v_proj"), rank=4, use_rslora=True,
                    # (An alternation: PEFT matches the key as one group, either name ending a module's.)
                    rank_pattern={"v_proj": 2}, alpha_pattern={"q_proj|v_proj": 3.0},
                ),
            ),
        }
        built[arch] = (root / "base", model, adapters)
    return built


def _engine(path, adapters: dict, **kwargs) -> LLMEngine:
    config = EngineConfig(
        num_kv_blocks=128, max_num_batched_tokens=64, long_prefill_chunk=16, num_threads=1,
        lora_adapters={name: str(directory) for name, (directory, _) in adapters.items()}, **kwargs,
    )
    return LLMEngine(path, config)


def _through(name: str | None, params: SamplingParams = GREEDY) -> SamplingParams:
    return dataclasses.replace(params, lora_name=name)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_adapters_and_base_in_one_batch_match_peft(adapted, arch):
    path, model, adapters = adapted[arch]
    prompts = random_prompts([4, 19, 37], model.config.vocab_size, seed=3)
    engine = _engine(path, adapters)
    names = [None, "every", "qv"]
    # Every prompt through every adapter and the base model, all in the same steps.
    jobs = [(prompt, name) for prompt in prompts for name in names]
    outputs = engine.generate([prompt for prompt, _ in jobs], [_through(name) for _, name in jobs])
    assert engine.num_free_blocks == engine.kv_cache.num_blocks
    by_job = {(tuple(prompt), name): out.token_ids for (prompt, name), out in zip(jobs, outputs)}
    for prompt in prompts:
        key = tuple(prompt)
        assert by_job[key, None] == hf_greedy(model, prompt, MAX_NEW), f"{arch}: the base model's rows changed"
        for name in ("every", "qv"):
            assert by_job[key, name] == hf_greedy(adapters[name][1], prompt, MAX_NEW), f"{arch}: adapter {name} differs from PEFT"
    # The adapters change what the model says (else the comparison above proves nothing).
    assert any(by_job[tuple(p), "every"] != by_job[tuple(p), None] for p in prompts)
    assert any(by_job[tuple(p), "qv"] != by_job[tuple(p), None] for p in prompts)


def test_adapter_prompt_scores_are_peft_log_probabilities(adapted):
    path, model, adapters = adapted["qwen2"]
    prompt = random_prompts([30], model.config.vocab_size, seed=5)[0]
    engine = _engine(path, adapters)
    scored = engine.generate([prompt], _through("every", dataclasses.replace(GREEDY, max_tokens=1, prompt_logprobs=0)))[0]
    with torch.no_grad():
        reference = torch.log_softmax(adapters["every"][1](torch.tensor([prompt])).logits[0].float(), dim=-1)
    got = [entry.logprob for entry in scored.prompt_logprobs]
    want = [float(reference[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    assert got == pytest.approx(want, abs=1e-4)


def test_prefix_cache_keeps_each_adapters_kv_apart(adapted):
    """The same prompt's blocks through the base model are never reused for an adapter's request
    (its KV differs); its own earlier request's are."""
    path, model, adapters = adapted["llama"]
    prompt = random_prompts([40], model.config.vocab_size, seed=7)[0]
    engine = _engine(path, adapters)
    runs = []

    def run(name):
        seq = engine.add_request(f"r-{len(runs)}", prompt, _through(name))
        runs.append(seq)
        while engine.has_unfinished_requests():
            engine.step()
        return seq

    base = run(None)
    first = run("every")
    again = run("every")
    assert first.num_cached_tokens == 0, "an adapter's request reused the base model's KV"
    assert again.num_cached_tokens >= 32, "an adapter's own prefix was not reused"
    want = hf_greedy(adapters["every"][1], prompt, MAX_NEW)
    assert first.output_token_ids == want and again.output_token_ids == want
    assert base.output_token_ids == hf_greedy(model, prompt, MAX_NEW)


def test_tensor_parallel_ranks_hold_their_slices_of_each_adapter(tmp_path):
    """Two gloo ranks (a single KV head replicated on both): column-parallel B rows and
    row-parallel A columns split as the base weights are, the partial deltas summed; an adapter
    loaded at runtime reaches every rank."""
    model = build_checkpoint("qwen2", tmp_path / "base", num_key_value_heads=1)
    adapter = build_lora_adapter(model, tmp_path / "every", seed=4)
    later = build_lora_adapter(model, tmp_path / "later", seed=5, targets=("q_proj", "o_proj", "down_proj"))
    prompts = random_prompts([5, 23], model.config.vocab_size, seed=9)
    engine = _engine(tmp_path / "base", {"every": (tmp_path / "every", adapter)}, tensor_parallel_size=2)
    try:
        engine.load_adapter("later", str(tmp_path / "later"))
        outputs = engine.generate(prompts * 3, [_through("every")] * 2 + [_through(None)] * 2 + [_through("later")] * 2)
    finally:
        engine.close()
    for prompt, out in zip(prompts, outputs[:2]):
        assert out.token_ids == hf_greedy(adapter, prompt, MAX_NEW)
    for prompt, out in zip(prompts, outputs[2:4]):
        assert out.token_ids == hf_greedy(model, prompt, MAX_NEW)
    for prompt, out in zip(prompts, outputs[4:]):
        assert out.token_ids == hf_greedy(later, prompt, MAX_NEW)


def test_an_adapter_loaded_unloaded_and_replaced_at_runtime(tmp_path):
    """Loaded while serving; unloaded with a request through it running (which finishes through
    it, while new ones are refused); loaded again, then replaced in place by a new version while
    a request runs through the old one: each request answers as the version it started with,
    and the new version never takes the old one's cached blocks."""
    model = build_checkpoint("llama", tmp_path / "base")
    first = build_lora_adapter(model, tmp_path / "v1", seed=11)
    second = build_lora_adapter(model, tmp_path / "v2", seed=12)
    engine = _engine(tmp_path / "base", {}, max_num_seqs=1)
    prompt = random_prompts([40], model.config.vocab_size, seed=13)[0]

    def finish():
        while engine.has_unfinished_requests():
            engine.step()

    digest = engine.load_adapter("policy", str(tmp_path / "v1"))
    running = engine.add_request("running", prompt, _through("policy"))
    waiting = engine.add_request("waiting", prompt[:5], _through("policy"))  # one sequence a step: it waits
    engine.step()
    stats = engine_stats(engine)
    assert (stats.num_lora_adapters, stats.running_lora_adapters, stats.waiting_lora_adapters) == (1, ["policy"], ["policy"])
    assert engine.unload_adapter("policy")
    with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'policy'"):
        engine.add_request("refused", prompt, _through("policy"))
    finish()
    assert running.output_token_ids == hf_greedy(first, prompt, MAX_NEW)
    assert waiting.output_token_ids == hf_greedy(first, prompt[:5], MAX_NEW), "a queued request lost its adapter to the unload"
    assert not engine.adapters, "the slot outlived its last request"

    assert engine.load_adapter("policy", str(tmp_path / "v1")) == digest
    with pytest.raises(InvalidRequestError, match="already loaded"):
        engine.load_adapter("policy", str(tmp_path / "v2"))
    old = engine.add_request("old", prompt, _through("policy"))
    engine.step()
    new_digest = engine.load_adapter("policy", str(tmp_path / "v2"), replace=True)
    assert new_digest != digest
    new = engine.add_request("new", prompt, _through("policy"))
    finish()
    assert old.output_token_ids == hf_greedy(first, prompt, MAX_NEW)
    assert new.output_token_ids == hf_greedy(second, prompt, MAX_NEW)
    assert new.num_cached_tokens == 0, "the new version reused the old version's KV"
    # The replaced version stays held for requests a router pinned to it, until dropped.
    pinned = engine.add_request("pinned", prompt, dataclasses.replace(_through("policy"), lora_digest=digest))
    assert engine.drop_adapter_version(digest)
    finish()
    assert pinned.output_token_ids == hf_greedy(first, prompt, MAX_NEW) and pinned.num_cached_tokens > 0
    assert engine.adapters.slots == {new_digest: new.adapter_slot} and not engine.adapters.retiring
    with pytest.raises(InvalidRequestError, match="is not held here"):
        engine.add_request("stale", prompt, dataclasses.replace(_through("policy"), lora_digest=digest))
    assert engine.num_free_blocks == engine.kv_cache.num_blocks
    assert not engine.unload_adapter("missing")
    with pytest.raises(ModelLoadError, match="does not exist"):
        engine.load_adapter("gone", str(tmp_path / "gone"))


@pytest.mark.parametrize("by_row_slot", [False, True])
def test_stacks_shrink_back_when_a_larger_adapter_is_unloaded(tmp_path, by_row_slot):
    """Every step through any adapter went through every slot's columns at the largest rank
    ever loaded: a rank-32 adapter loaded once and unloaded left a rank-4 one's stacks 2 x 32
    wide for good (memory, and on a GPU the decode step's work)."""
    model = build_checkpoint("llama", tmp_path / "base")
    small = build_lora_adapter(model, tmp_path / "small", seed=41, rank=4)
    build_lora_adapter(model, tmp_path / "large", seed=42, rank=32)
    engine = _engine(tmp_path / "base", {})
    engine.runner.decode_adapters_by_row_slot = by_row_slot
    engine.load_adapter("small", str(tmp_path / "small"))

    def shapes() -> list[tuple]:
        return [(stack.a.shape, stack.b.shape) for layer in engine.runner.model.layers for stack in layer.lora.values()]

    alone = shapes()
    assert {a[0] for a, _ in alone} == {1}
    engine.load_adapter("large", str(tmp_path / "large"))
    assert shapes() != alone and {a[0] for a, _ in shapes()} == {2}
    assert engine.unload_adapter("large")
    prompt = random_prompts([9], model.config.vocab_size, seed=43)[0]
    assert engine.generate([prompt], _through("small"))[0].token_ids == hf_greedy(small, prompt, MAX_NEW)
    assert shapes() == alone, "the unloaded adapter's slot and rank still padded the stacks"


def test_max_lora_rank_bounds_the_adapters_loaded(tmp_path):
    """vLLM's --max-lora-rank: a runtime load, or a configured adapter, of a rank above it is
    refused naming the field (nothing bounded how wide runtime loads made every step)."""
    model = build_checkpoint("llama", tmp_path / "base")
    for seed, (name, rank) in enumerate((("narrow", 4), ("wide", 16))):
        build_lora_adapter(model, tmp_path / name, seed=51 + seed, rank=rank)
    engine = _engine(tmp_path / "base", {}, max_lora_rank=8)
    with pytest.raises(InvalidRequestError, match="rank 16 is above max_lora_rank = 8") as refused:
        engine.load_adapter("wide", str(tmp_path / "wide"))
    assert refused.value.field == "lora_path"
    engine.load_adapter("narrow", str(tmp_path / "narrow"))
    assert engine.adapters.served.keys() == {"narrow"}
    with pytest.raises(ModelLoadError, match="lora_adapters.wide: the adapter's rank 16 is above max_lora_rank = 8"):
        _engine(tmp_path / "base", {"wide": (tmp_path / "wide", None)}, max_lora_rank=8)


def test_speculative_drafts_are_verified_through_the_adapter(adapted):
    """N-gram drafts of a repetitive prompt are verified by the adapted model: the output is
    PEFT's greedy one, drafts included."""
    from engine.speculation import SpeculativeConfig

    path, model, adapters = adapted["qwen3"]
    pattern = random_prompts([6], model.config.vocab_size, seed=21)[0]
    prompts = [pattern * 5, (pattern[::-1]) * 4]
    engine = _engine(path, adapters, speculative=SpeculativeConfig(num_speculative_tokens=3))
    seqs = [engine.add_request(f"s{i}", prompt, _through(name)) for i, (prompt, name) in enumerate(zip(prompts * 2, ["every", "every", None, "qv"]))]
    while engine.has_unfinished_requests():
        engine.step()
    for seq, prompt, name in zip(seqs, prompts * 2, ["every", "every", None, "qv"]):
        reference = model if name is None else adapters[name][1]
        assert seq.output_token_ids == hf_greedy(reference, prompt, MAX_NEW), name
    assert sum(seq.num_draft_tokens for seq in seqs) > 0, "no draft was proposed: the test proves nothing"


def test_unknown_adapter_is_refused_naming_the_field(adapted):
    path, model, adapters = adapted["llama"]
    engine = _engine(path, adapters)
    with pytest.raises(InvalidRequestError) as caught:
        engine.add_request("r", [5, 6, 7], _through("missing"))
    assert caught.value.field == "lora_name" and "missing" in caught.value.problem and "every" in caught.value.problem
    assert engine.num_free_blocks == engine.kv_cache.num_blocks


def test_adapter_of_another_model_or_kind_is_refused_at_load(adapted, tmp_path):
    path, model, adapters = adapted["llama"]
    other = build_checkpoint("llama", tmp_path / "wider", hidden_size=96)
    build_lora_adapter(other, tmp_path / "wider_adapter", seed=1)
    with pytest.raises(ModelLoadError, match="another model"):
        _engine(path, {"wider": (tmp_path / "wider_adapter", None)})

    dora = tmp_path / "dora"
    build_lora_adapter(model, dora, seed=1)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ModelLoadError, match="DoRA"):
        _engine(path, {"dora": (dora, None)})
    for init in ("pissa_niter_4", "olora", "corda", "loftq"):  # trained on a base they rewrote: refused, naming the conversion
        (dora / "adapter_config.json").write_text(json.dumps({**config, "init_lora_weights": init}))
        with pytest.raises(ModelLoadError, match=f"init_lora_weights '{init}'.*path_initial_model_for_weight_conversion"):
            _engine(path, {"residual": (dora, None)})

    embedding = tmp_path / "embedding"
    build_lora_adapter(model, embedding, seed=1, targets=("q_proj", "embed_tokens"))
    with pytest.raises(ModelLoadError, match="embed_tokens"):
        _engine(path, {"embedding": (embedding, None)})

    with pytest.raises(ModelLoadError, match="does not exist"):
        _engine(path, {"gone": (tmp_path / "gone", None)})


@pytest.mark.parametrize("by_row_slot", [False, True])
def test_slots_reused_by_adapters_on_other_projections_keep_every_row_right(tmp_path, monkeypatch, by_row_slot):
    """Adapters on disjoint projections and of different ranks loaded, unloaded and loaded again
    into freed slots (the stacks rebuilt), then all in one batch with their rows interleaved with
    base rows: each row through its own adapter's weights. ``by_row_slot``: decode steps the GPU's
    way, taken here on the CPU (engine.lora.RowSlots: every slot's pairs side by side, a row's
    other columns zeroed; what a CUDA graph replays for any mix of adapters)."""
    from engine import lora

    taken = []
    original = lora.RowSlots.add_deltas
    monkeypatch.setattr(lora.RowSlots, "add_deltas", lambda self, out, x, stack: taken.append(1) or original(self, out, x, stack))
    model = build_checkpoint("llama", tmp_path / "base")
    made = {
        "q": build_lora_adapter(model, tmp_path / "q", seed=31, targets=("q_proj",)),
        "down": build_lora_adapter(model, tmp_path / "down", seed=32, targets=("down_proj",), rank=16),
        "gate": build_lora_adapter(model, tmp_path / "gate", seed=33, targets=("gate_proj", "v_proj"), rank=2),
    }
    engine = _engine(tmp_path / "base", {})
    engine.runner.decode_adapters_by_row_slot = by_row_slot
    engine.load_adapter("gate", str(tmp_path / "gate"))
    engine.load_adapter("q", str(tmp_path / "q"))
    engine.unload_adapter("gate")  # slot 0 freed, slot 1 kept
    engine.load_adapter("down", str(tmp_path / "down"))  # into slot 0: the first adapter on down_proj
    prompts = random_prompts([7, 12, 9], model.config.vocab_size, seed=34)
    names = ["down", "q", None]
    jobs = [(prompt, name) for prompt in prompts for name in names]
    outputs = engine.generate([p for p, _ in jobs], [_through(name) for _, name in jobs])
    for (prompt, name), out in zip(jobs, outputs):
        assert out.token_ids == hf_greedy(model if name is None else made[name], prompt, MAX_NEW), name
    assert bool(taken) == by_row_slot, "decode steps did not take the path under test"
    assert engine.runner.model.lora_version == 4  # each load and unload made new stacks: graphs over the old ones are stale


def test_a_long_prompt_chunk_beside_other_adapters_decode_rows(adapted, monkeypatch, tmp_path):
    """One adapter's long prompt chunk and single decode rows of two others in the same steps,
    the rows interleaved: each group's matmuls over its own rows (not padded to the longest), and
    every output PEFT's."""
    from engine import lora

    path, model, adapters = adapted["llama"]
    third = (tmp_path / "third", build_lora_adapter(model, tmp_path / "third", seed=43, targets=("o_proj", "up_proj")))
    adapters = {**adapters, "third": third}
    engine = _engine(path, adapters)
    grouped = []
    original = lora._Grouped.of.__func__
    monkeypatch.setattr(lora._Grouped, "of", classmethod(lambda cls, rows, device: grouped.append(original(cls, rows, device)) or grouped[-1]))
    short = random_prompts([3, 4], model.config.vocab_size, seed=41)
    names = ["qv", "third"]
    seqs = [engine.add_request(f"d{i}", p, _through(name)) for i, (p, name) in enumerate(zip(short, names))]
    engine.step()  # both short prompts computed: they decode from here
    long_prompt = random_prompts([60], model.config.vocab_size, seed=42)[0]
    seqs.append(engine.add_request("long", long_prompt, _through("every")))
    seqs.append(engine.add_request("d2", short[0], _through("qv")))
    while engine.has_unfinished_requests():
        engine.step()
    for seq, prompt, name in zip(seqs, [*short, long_prompt, short[0]], ["qv", "third", "every", "qv"]):
        assert seq.output_token_ids == hf_greedy(adapters[name][1], prompt, MAX_NEW), name
    assert any(g.runs is not None for g in grouped), "no step took the per-group path: the test proves nothing"
    assert any(g.runs is None for g in grouped), "no step took the batched path"



def test_ranks_agree_on_an_adapter_change_with_a_tally_on_the_models_device():
    """The ranks' tally of failed adapter loads is reduced on the model's device: an NCCL group
    reduces CUDA tensors only, and a host tally raised on every rank (the group taken for broken,
    every GPU tensor-parallel worker ended by a runtime LoRA load or unload). Checked here with the
    meta device, as CPU is the host."""
    from types import SimpleNamespace

    from engine.executor import AdapterChange

    reduced = []

    class Group:
        def all_reduce(self, tensor):
            reduced.append(tensor.device)
            return torch.zeros(1)

    model = SimpleNamespace(layers=[])
    assert AdapterChange(0, None).apply_on_rank(model, torch.float32, "meta", Group()) is None
    assert reduced == [torch.device("meta")]
