"""Bad requests and bad checkpoints are refused with errors that name the problem."""

from __future__ import annotations

import json
import shutil

import pytest

from engine import EngineConfig, InvalidRequestError, LLMEngine, ModelLoadError, SamplingParams
from tests.checkpoints import random_prompts


@pytest.fixture(scope="module")
def engine(checkpoints):
    path, _ = checkpoints["llama"]
    return LLMEngine(path, EngineConfig(num_kv_blocks=64, max_model_len=256))


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ([], SamplingParams(), "prompt"),
        (list(range(3, 259)), SamplingParams(), "prompt"),  # 256 tokens: the whole context
        ([5, 6], SamplingParams(max_tokens=0), "max_tokens"),
        ([5, 6], SamplingParams(temperature=-0.5), "temperature"),
        ([5, 6], SamplingParams(temperature=float("nan")), "temperature"),
        ([5, 6], SamplingParams(top_p=0.0), "top_p"),
        ([5, 6], SamplingParams(top_p=1.5), "top_p"),
        ([5, 6], SamplingParams(top_k=-2), "top_k"),
        ([5, 6], SamplingParams(min_p=1.1), "min_p"),
        ([5, 6], SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        ([5, 6], SamplingParams(seed=-(2**63) - 1), "seed"),  # below a 64-bit integer (-1 is a seed, as in vLLM)
        ([5, 6], SamplingParams(logprobs=500), "logprobs"),
        ([5, 6], SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
        ([5, 10**6], SamplingParams(), "prompt_token_ids"),
    ],
)
def test_bad_requests_are_refused_with_the_field_named(engine, prompt, params, field):
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("bad", prompt, params)
    assert info.value.field == field
    assert field in str(info.value)
    assert not engine.has_unfinished_requests(), "nothing of a refused request stays queued"
    assert engine.num_free_blocks == 64


def test_request_larger_than_the_whole_cache_is_refused(checkpoints):
    path, _ = checkpoints["llama"]
    small = LLMEngine(path, EngineConfig(num_kv_blocks=4, block_size=16))
    with pytest.raises(InvalidRequestError, match="KV blocks") as info:
        small.add_request("big", list(range(3, 40)), SamplingParams(max_tokens=64))
    assert info.value.field == "max_tokens"
    small.add_request("fits", list(range(3, 40)), SamplingParams(max_tokens=20))


def test_engine_keeps_serving_after_refusals(engine, checkpoints):
    _, model = checkpoints["llama"]
    with pytest.raises(InvalidRequestError):
        engine.add_request("bad", [], SamplingParams())
    (out,) = engine.generate(random_prompts([4], model.config.vocab_size), SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out.token_ids) == 3


def test_duplicate_request_id_is_refused(engine):
    engine.add_request("dup", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="request_id"):
        engine.add_request("dup", [5, 6, 7], SamplingParams(max_tokens=2))
    engine.abort_request("dup")


def test_unknown_architecture_names_the_supported_ones(checkpoints, tmp_path):
    src, _ = checkpoints["qwen2"]
    shutil.copytree(src, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as info:
        LLMEngine(tmp_path / "m", EngineConfig(num_kv_blocks=8))
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert supported in message


def test_missing_weight_file_is_named(checkpoints, tmp_path):
    src, _ = checkpoints["llama"]  # sharded
    shutil.copytree(src, tmp_path / "m")
    victim = sorted((tmp_path / "m").glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=victim.name):
        LLMEngine(tmp_path / "m", EngineConfig(num_kv_blocks=8))


def test_missing_weights_and_missing_tensor_are_reported(checkpoints, tmp_path):
    src, _ = checkpoints["qwen3"]
    shutil.copytree(src, tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLMEngine(tmp_path / "m", EngineConfig(num_kv_blocks=8))
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLMEngine(tmp_path / "nowhere", EngineConfig(num_kv_blocks=8))


def test_bad_engine_config_names_the_field(checkpoints):
    path, _ = checkpoints["llama"]
    with pytest.raises(ValueError, match="block_size"):
        LLMEngine(path, EngineConfig(block_size=0))
    with pytest.raises(ValueError, match="dtype"):
        LLMEngine(path, EngineConfig(dtype="int8"))
