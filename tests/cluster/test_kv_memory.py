"""The default KV cache size: the rule's arithmetic, what an actor measures, and the config that selects it."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from cluster.config import load_config
from cluster.kv_memory import GiB, MiB, KVMemoryPolicy, MemoryFigures, activation_bytes, default_kv_cache_bytes, measure, sized_engine_config
from engine.config import EngineConfig, ModelConfig


def cpu(available_gib: float, weights_mib: float = 0, useful_gib: float | None = None) -> MemoryFigures:
    useful = None if useful_gib is None else int(useful_gib * GiB)
    return MemoryFigures("cpu", host_available=int(available_gib * GiB), weight_bytes=int(weights_mib * MiB), max_useful_bytes=useful)


def test_cpu_takes_half_the_available_memory_split_among_the_actors_starting_there_less_weights():
    # 64 GiB available, half for KV, 4 actors: 8 GiB each, less 1 GiB of weights.
    assert default_kv_cache_bytes(KVMemoryPolicy(num_sharing=4), cpu(64, weights_mib=1024)) == 7 * GiB
    assert default_kv_cache_bytes(KVMemoryPolicy(num_sharing=1, host_memory_fraction=0.25), cpu(16)) == 4 * GiB


def test_cpu_share_is_capped_per_actor_and_never_below_the_floor():
    assert default_kv_cache_bytes(KVMemoryPolicy(), cpu(512)) == 16 * GiB
    assert default_kv_cache_bytes(KVMemoryPolicy(max_host_bytes=2 * GiB), cpu(512)) == 2 * GiB
    # 1 GiB available among 8 actors with 200 MiB of weights each: nothing left; the floor holds.
    assert default_kv_cache_bytes(KVMemoryPolicy(num_sharing=8), cpu(1, weights_mib=200)) == 64 * MiB


def test_never_more_than_max_num_seqs_full_length_sequences_can_use():
    assert default_kv_cache_bytes(KVMemoryPolicy(), cpu(64, useful_gib=0.5)) == 512 * MiB


def test_cuda_takes_the_utilization_share_of_the_gpu_less_other_processes_weights_and_activations():
    figures = MemoryFigures("cuda", gpu_total=80 * GiB, gpu_free=79 * GiB, weight_bytes=16 * GiB, activation_bytes=2 * GiB)
    # 0.9 * 80 = 72 GiB, less 1 GiB held by another process, 16 GiB of weights and 2 GiB of activations.
    assert default_kv_cache_bytes(KVMemoryPolicy(gpu_memory_utilization=0.9), figures) == 53 * GiB
    # Two actors on one GPU (num_gpus 0.5) take half of the 72 GiB each, less their own weights.
    shared = KVMemoryPolicy(gpu_memory_utilization=0.9, num_sharing=2)
    assert default_kv_cache_bytes(shared, figures) == 36 * GiB - 18 * GiB
    # A replacement beside a survivor holding its 36 GiB (weights, activations, KV) gets the
    # same share (it got the 64 MiB floor: the survivor's memory subtracted, then halved again).
    beside = MemoryFigures("cuda", gpu_total=80 * GiB, gpu_free=44 * GiB, weight_bytes=16 * GiB, activation_bytes=2 * GiB)
    assert default_kv_cache_bytes(shared, beside) == pytest.approx(18 * GiB, abs=MiB)
    # What is free bounds it: beside a foreign process holding 30 GiB it keeps 8 GiB of headroom.
    crowded = MemoryFigures("cuda", gpu_total=80 * GiB, gpu_free=13 * GiB, weight_bytes=2 * GiB, activation_bytes=1 * GiB)
    assert default_kv_cache_bytes(shared, crowded) == pytest.approx(13 * GiB - 8 * GiB - 3 * GiB, abs=MiB)
    # Host memory plays no part on a GPU.
    assert default_kv_cache_bytes(KVMemoryPolicy(), figures) == default_kv_cache_bytes(
        KVMemoryPolicy(), MemoryFigures(**{**_fields(figures), "host_available": 1})
    )


@pytest.fixture
def model_dir(tmp_path):
    config = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 8,
        "num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1000,
        "max_position_embeddings": 1000, "dtype": "float32",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 4000)
    return tmp_path


def test_an_actor_measures_its_host_and_estimates_weights_and_useful_size_from_the_checkpoint(model_dir):
    engine = EngineConfig(dtype="bfloat16", block_size=16, max_num_seqs=3, max_model_len=None, max_num_batched_tokens=8)
    figures = measure(engine, model_dir)
    assert figures.device == "cpu" and figures.host_available > 0
    assert figures.weight_bytes == 2000, "a float32 checkpoint loaded in bfloat16 takes half its file size"
    # 3 sequences of 1000 tokens (63 blocks of 16 = 1008 slots), 4 layers x K,V x 2 heads x 32 dims x 2 bytes.
    assert figures.max_useful_bytes == 3 * 1008 * 4 * 2 * 2 * 32 * 2
    assert figures.activation_bytes == 8 * (4 * 1000 + 4 * 2 * 688)


def test_on_a_gpu_the_reserve_counts_flashinfers_scratch_and_the_decode_graphs(model_dir):
    """A GPU engine also holds FlashInfer's 256 MiB scratch and its decode graphs' memory (a float32
    logits buffer and activations for the largest bucket, min(cuda_graph_max_batch, max_num_seqs)
    rows): the KV cache is sized without them."""
    model = ModelConfig.from_model_dir(model_dir)
    per_token = 4 * 1000 + 4 * 2 * 688
    fields = dict(max_num_seqs=64, max_num_batched_tokens=8)
    cpu = activation_bytes(EngineConfig(**fields), model, 2)
    assert cpu == 8 * per_token
    assert activation_bytes(EngineConfig(device="cuda", **fields), model, 2) - cpu == 256 * MiB + 64 * per_token
    assert activation_bytes(EngineConfig(device="cuda", cuda_graph_max_batch=16, **fields), model, 2) - cpu == 256 * MiB + 16 * per_token
    assert activation_bytes(EngineConfig(device="cuda", cuda_graph_max_batch=0, **fields), model, 2) - cpu == 256 * MiB


def test_the_chosen_size_replaces_the_engine_configs_and_is_logged(model_dir, caplog):
    engine = EngineConfig(num_kv_blocks=7, max_num_seqs=2, max_model_len=64)
    with caplog.at_level(logging.INFO, logger="cluster.kv_memory"):
        sized = sized_engine_config(engine, str(model_dir), KVMemoryPolicy(), "decode-0")
    # Two 64-token sequences are all that can ever be used: 2 * 64 * 4 * 2 * 2 * 32 * 4 bytes.
    assert sized.num_kv_blocks is None and sized.kv_cache_bytes == 2 * 64 * 2048
    assert "decode-0: KV cache 0.2 MiB (device cpu" in caplog.text


def test_the_deployment_config_sizes_kv_from_the_machine_unless_kv_cache_mb_is_given():
    spec = load_config(None, {"gpu_memory_utilization": 0.8}).to_spec()
    assert spec.decode.kv_memory == KVMemoryPolicy(gpu_memory_utilization=0.8, host_memory_fraction=0.5)
    explicit = load_config(None, {"decode.kv_cache_mb": 300}).to_spec()
    assert explicit.decode.kv_memory is None and explicit.decode.engine.kv_cache_bytes == 300 * MiB
    assert explicit.prefill.kv_memory is not None


def _fields(figures: MemoryFigures) -> dict:
    return {name: getattr(figures, name) for name in MemoryFigures.__slots__}


def test_actors_that_may_share_memory_divide_it():
    from cluster.pools import PoolSpec, _num_sharing

    assert _num_sharing(PoolSpec(num_gpus=0.5), num_starting=6) == 2, "two actors per GPU"
    assert _num_sharing(PoolSpec(num_gpus=1), num_starting=6) == 1
    assert _num_sharing(PoolSpec(resources={"prefill_node": 1}), num_starting=3) == 3, "pinned: maybe all on one node"


def test_weights_are_the_files_the_loader_reads_and_a_draft_models_too(model_dir, tmp_path_factory):
    """Repositories ship more than one copy of the weights (PyTorch .bin files beside the
    safetensors; Mistral's consolidated file beside an index): each was counted and taken from
    the KV budget (a 7B model's cache fell to its floor on a 24 GB GPU). A draft model's weights
    sit beside the target's and count."""
    from engine.speculation import SpeculativeConfig

    engine = EngineConfig(dtype="bfloat16", block_size=16, max_num_seqs=3, max_model_len=None, max_num_batched_tokens=8)
    (model_dir / "pytorch_model.bin").write_bytes(b"\0" * 4000)
    assert measure(engine, model_dir).weight_bytes == 2000
    (model_dir / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 6000)
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    assert measure(engine, model_dir).weight_bytes == 3000  # the index's file only, not model.safetensors beside it
    draft = tmp_path_factory.mktemp("draft")
    (draft / "config.json").write_text((model_dir / "config.json").read_text())
    (draft / "model.safetensors").write_bytes(b"\0" * 1000)
    speculating = dataclasses.replace(engine, speculative=SpeculativeConfig(method="draft_model", num_speculative_tokens=2, draft_model=str(draft)))
    assert measure(speculating, model_dir).weight_bytes == 3500
