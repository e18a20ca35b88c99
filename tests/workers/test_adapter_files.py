"""A LoRA adapter's files carried to a worker: written out on its node they are the adapter
(the same digest and tensors as its directory), once per contents, whatever happens to the
directory they were read from."""

from __future__ import annotations

import shutil

import torch

from engine.config import ModelConfig
from engine.lora_loading import adapter_digest, load_adapter
from engine.parallel.shard import TPShard
from tests.checkpoints import build_lora_adapter
from workers.adapter_files import AdapterFiles


def test_files_written_out_elsewhere_are_the_adapter_read(e2e_model, tmp_path):
    source = tmp_path / "policy"
    build_lora_adapter(e2e_model.hf_model, source, seed=5)
    (source / "README.md").write_text("not read by the loader: not carried")
    files = AdapterFiles.read(source)
    assert set(files.files) == {"adapter_config.json", "adapter_model.safetensors"} and files.source == str(source)
    digest = adapter_digest(source)
    model = ModelConfig.from_model_dir(e2e_model.path)
    want = load_adapter(source, model, TPShard.of(model), torch.float32, "cpu")

    # The trainer writes its next version into the same place: what was read stays what it was.
    shutil.rmtree(source)
    build_lora_adapter(e2e_model.hf_model, source, seed=6)
    assert adapter_digest(source) != digest

    node_cache = tmp_path / "node"
    on_node = files.on_node(node_cache)
    assert on_node.parent == node_cache and adapter_digest(on_node) == digest
    got = load_adapter(on_node, model, TPShard.of(model), torch.float32, "cpu")
    assert all(torch.equal(a[p].a_t, b[p].a_t) and torch.equal(a[p].b_t, b[p].b_t) for a, b in zip(got, want) for p in a)
    # Once per contents: a second worker of the node finds it written; nothing half-written is left.
    assert files.on_node(node_cache) == on_node and [p.name for p in node_cache.iterdir()] == [on_node.name]
    with files.written() as directory:
        assert adapter_digest(directory) == digest
    assert not directory.exists()
    assert AdapterFiles.read(tmp_path / "missing") is None and AdapterFiles.read("org/adapter-id") is None


def test_a_directory_without_an_adapter_config_is_not_read(tmp_path):
    """A model's directory named by mistake (or on purpose) was read whole into the router's
    memory, every safetensors file of it, before a worker refused it as no adapter."""
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1024)
    assert AdapterFiles.read(tmp_path) is None
