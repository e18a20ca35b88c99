"""A model named by its Hugging Face id is found in the local cache, offline; anything else is
refused saying where pdserve looked."""

from __future__ import annotations

import shutil

import pytest

from engine.errors import ModelLoadError
from engine.model_source import resolve_model

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, e2e_model):
    """A Hugging Face cache holding the e2e model as org/tiny-model, laid out as the hub lays it out."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny-model"
    shutil.copytree(e2e_model.path, repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return repo / "snapshots" / REVISION


def test_an_id_resolves_to_its_snapshot_and_keeps_its_name(hub_cache):
    resolved = resolve_model("org/tiny-model")
    assert resolved.path == hub_cache and resolved.name == "org/tiny-model" and resolved.from_hub
    assert resolve_model(f"org/tiny-model@{REVISION}").path == hub_cache


def test_a_directory_is_taken_as_it_is(e2e_model):
    resolved = resolve_model(e2e_model.path)
    assert resolved.path == e2e_model.path and not resolved.from_hub


@pytest.mark.parametrize("name, says", [("org/not-downloaded", "huggingface-cli download org/not-downloaded"), ("./no/such/dir", "no such model directory")])
def test_what_cannot_be_found_is_refused_saying_where(hub_cache, name, says):
    with pytest.raises(ModelLoadError, match=says):
        resolve_model(name)


def test_pdserve_up_config_takes_an_id_and_answers_to_it(hub_cache):
    from cluster.config import load_config

    config = load_config(None, {"model": "org/tiny-model"})
    assert config.model == hub_cache
    assert config.to_spec().router.served_model_names == ["org/tiny-model"]
    named = load_config(None, {"model": "org/tiny-model", "router.served_model_names": ["tiny"]})
    assert named.to_spec().router.served_model_names == ["tiny"]


def test_each_node_resolves_the_id_in_its_own_cache(hub_cache, tmp_path, monkeypatch):
    """The deployment carries the id, not this node's snapshot path: a node whose cache lives
    elsewhere finds the model there."""
    from cluster.config import load_config

    spec = load_config(None, {"model": "org/tiny-model"}).to_spec()
    assert spec.model_source == "org/tiny-model"
    other_node_cache = tmp_path / "other-node-hub"
    shutil.copytree(hub_cache.parents[2], other_node_cache)
    monkeypatch.setenv("HF_HUB_CACHE", str(other_node_cache))
    assert resolve_model(spec.model_source).path == other_node_cache / "models--org--tiny-model" / "snapshots" / REVISION


def test_a_lora_adapter_named_by_its_id_is_read_from_the_cache(hub_cache, e2e_model, tmp_path):
    """vLLM's --lora-modules NAME=org/adapter: the adapter's snapshot in the cache, read as its
    directory is; the deployment carries the id, so each worker resolves it on its own node."""
    import torch

    from cluster.config import load_config
    from engine.config import ModelConfig
    from engine.lora_loading import adapter_digest, load_adapter
    from engine.parallel.shard import TPShard
    from tests.checkpoints import build_lora_adapter

    repo = hub_cache.parents[1]
    adapter_repo = repo.parent / "models--org--tiny-lora"
    build_lora_adapter(e2e_model.hf_model, adapter_repo / "snapshots" / REVISION, seed=3)
    (adapter_repo / "refs").mkdir()
    (adapter_repo / "refs" / "main").write_text(REVISION)
    model = ModelConfig.from_model_dir(e2e_model.path)
    by_id = load_adapter("org/tiny-lora", model, TPShard.of(model), torch.float32, "cpu")
    by_dir = load_adapter(adapter_repo / "snapshots" / REVISION, model, TPShard.of(model), torch.float32, "cpu")
    assert len(by_id) == len(by_dir) and all(
        torch.equal(a[name].a_t, b[name].a_t) and torch.equal(a[name].b_t, b[name].b_t) for a, b in zip(by_id, by_dir) for name in a
    )
    assert adapter_digest("org/tiny-lora") == adapter_digest(adapter_repo / "snapshots" / REVISION)
    spec = load_config(None, {"model": str(e2e_model.path), "lora_modules": {"sql": "org/tiny-lora"}}).to_spec()
    assert spec.decode.engine.lora_adapters == {"sql": "org/tiny-lora"}
    with pytest.raises(ModelLoadError, match="huggingface-cli download org/no-lora"):
        load_adapter("org/no-lora", model, TPShard.of(model), torch.float32, "cpu")
