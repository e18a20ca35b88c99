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
