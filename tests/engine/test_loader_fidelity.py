"""Checkpoints load as transformers runs them: biases, every RoPE schedule, and a clear refusal
for what the engine cannot run (quantized weights, unknown dtypes, tensors it has no place for)."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.rope import inverse_frequencies
from tests.checkpoints import build_checkpoint, hf_config, hf_greedy, random_prompts

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
HALF_HEAD = 8  # the test checkpoints' head_dim (64 / 4) / 2 rotation pairs

ROPES = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale": 0.7, "mscale_all_dim": 1.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "longrope": {
        "rope_type": "longrope",
        "original_max_position_embeddings": 64,
        "short_factor": [1.0 + 0.1 * i for i in range(HALF_HEAD)],
        "long_factor": [1.5 + 0.4 * i for i in range(HALF_HEAD)],
    },
}


def _engine_matches_transformers(path, model, lengths=(5, 40), max_model_len=None):
    prompts = random_prompts(list(lengths), model.config.vocab_size, seed=3)
    engine = LLMEngine(path, EngineConfig(num_kv_blocks=64, long_prefill_chunk=16, max_num_batched_tokens=64, max_model_len=max_model_len))
    got = [c.token_ids for c in engine.generate(prompts, GREEDY)]
    assert got == [hf_greedy(model, p, 10) for p in prompts]
    # Log-probabilities too, not only the argmax (float32).
    prompt = prompts[-1]
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0, -1]
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))
    top = dict(out.logprobs[0].top)
    reference = torch.log_softmax(want.double(), dim=-1)
    for token, logprob in top.items():
        assert logprob == pytest.approx(reference[token].item(), abs=1e-4)


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("llama", {"attention_bias": True}),
        ("llama", {"mlp_bias": True}),
        ("llama", {"attention_bias": True, "mlp_bias": True, "rope_scaling": None}),
        ("qwen3", {"attention_bias": True}),
    ],
)
def test_biases_are_loaded_and_used(tmp_path, arch, overrides):
    model = build_checkpoint(arch, tmp_path, **overrides)
    config = ModelConfig.from_model_dir(tmp_path)
    assert config.o_bias == overrides.get("attention_bias", False)
    assert config.mlp_bias == overrides.get("mlp_bias", False)
    _engine_matches_transformers(tmp_path, model)


@pytest.mark.parametrize("name", sorted(ROPES))
def test_each_rope_schedule_matches_transformers(tmp_path, name):
    model = build_checkpoint("llama", tmp_path, rope_scaling=ROPES[name], max_position_embeddings=256)
    # Within the pretraining context, the schedule transformers uses for such sequences.
    _engine_matches_transformers(tmp_path, model, max_model_len=64 if name == "longrope" else None)


@pytest.mark.parametrize("name, seq_len", [("yarn", 100), ("dynamic", 400), ("longrope", 200), ("longrope", 50)])
def test_rope_frequencies_equal_transformers_at_a_length(name, seq_len):
    """The frequencies and cos/sin scale transformers computes for a sequence of seq_len, which
    the engine uses when its context is seq_len."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = hf_config("llama", rope_scaling=ROPES[name], max_position_embeddings=256)
    want, want_scale = ROPE_INIT_FUNCTIONS[ROPES[name]["rope_type"]](hf, "cpu", seq_len=seq_len)
    config = ModelConfig.from_dict(json.loads(hf.to_json_string()) | {"architectures": ["LlamaForCausalLM"]})
    got, scale = inverse_frequencies(config.rope, config.head_dim, seq_len)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(want_scale, rel=1e-6)


def test_a_context_past_the_pretraining_one_says_short_sequences_leave_transformers_schedule(caplog):
    """LongRoPE checkpoints declare a long context, the engine's default: every sequence then
    rotates by the long factors, where transformers keeps the short ones for a short sequence.
    Said at start, with the max_model_len that gives transformers' output."""
    from engine.rope import RotaryEmbedding

    hf = hf_config("llama", rope_scaling=ROPES["longrope"], max_position_embeddings=256)
    config = ModelConfig.from_dict(json.loads(hf.to_json_string()) | {"architectures": ["LlamaForCausalLM"]})
    original = config.rope.original_max_position
    with caplog.at_level("WARNING", logger="engine.rope"):
        RotaryEmbedding(config.rope, config.head_dim, original, torch.float32, "cpu")
        assert caplog.records == []
        RotaryEmbedding(config.rope, config.head_dim, 256, torch.float32, "cpu")
    (record,) = caplog.records
    assert f"max_model_len {original} gives its output there" in record.getMessage()


def test_a_quantized_checkpoint_is_refused_naming_the_method(tmp_path):
    build_checkpoint("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="quantized checkpoint.*fp8"):
        LLMEngine(tmp_path, EngineConfig(num_kv_blocks=8))


def test_integer_or_fp8_weights_and_unknown_dtypes_are_refused(tmp_path):
    build_checkpoint("llama", tmp_path)
    (weights_file,) = tmp_path.glob("*.safetensors")
    weights = load_file(weights_file)
    weights["model.layers.0.mlp.down_proj.weight"] = weights["model.layers.0.mlp.down_proj.weight"].to(torch.int8)
    save_file(weights, weights_file)
    with pytest.raises(ModelLoadError, match="down_proj.weight.*int8"):
        LLMEngine(tmp_path, EngineConfig(num_kv_blocks=8))
    config = json.loads((tmp_path / "config.json").read_text())
    config["dtype"] = "float8_e4m3fn"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="dtype 'float8_e4m3fn' is not supported"):
        ModelConfig.from_model_dir(tmp_path)


def test_a_tensor_the_model_has_no_place_for_is_refused(tmp_path):
    """A bias the config does not announce used to be dropped with a warning: wrong output."""
    build_checkpoint("mistral", tmp_path)
    (weights_file,) = tmp_path.glob("*.safetensors")
    weights = load_file(weights_file)
    weights["model.layers.1.self_attn.o_proj.bias"] = torch.ones(64)
    save_file(weights, weights_file)
    with pytest.raises(ModelLoadError, match="no place for: model.layers.1.self_attn.o_proj.bias"):
        LLMEngine(tmp_path, EngineConfig(num_kv_blocks=8))


def test_partial_rotary_and_unknown_rope_types_are_refused():
    base = json.loads(hf_config("llama").to_json_string()) | {"architectures": ["LlamaForCausalLM"]}
    with pytest.raises(ModelLoadError, match="partial_rotary_factor"):
        ModelConfig.from_dict(base | {"partial_rotary_factor": 0.5})
    with pytest.raises(ModelLoadError, match="rope scaling type 'su'"):
        ModelConfig.from_dict(base | {"rope_scaling": {"rope_type": "su", "factor": 2.0}, "rope_parameters": None})


@pytest.mark.parametrize("model_type, architecture", [("qwen3", "Qwen3ForCausalLM"), ("qwen2", "Qwen2ForCausalLM"), ("mistral", "MistralForCausalLM"),
                                                       ("llama", "LlamaForCausalLM")])
def test_fields_a_config_leaves_out_take_the_familys_defaults_as_transformers_reads_them(model_type, architecture):
    """A config.json without head_dim, num_key_value_heads, max_position_embeddings, a window
    or max_window_layers took Llama's defaults for every family: a Qwen3 one failed on a
    tensor's size (head_dim 128 in transformers), a Qwen2 one put its windows elsewhere."""
    from transformers import CONFIG_MAPPING

    raw = {"model_type": model_type, "architectures": [architecture], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 30, "num_attention_heads": 4}
    if model_type == "qwen2":
        raw |= {"use_sliding_window": True, "sliding_window": 16}
    ours = ModelConfig.from_dict(raw)
    theirs = CONFIG_MAPPING[model_type](**{k: v for k, v in raw.items() if k != "model_type"})
    assert (ours.num_kv_heads, ours.max_position_embeddings, ours.rms_norm_eps) == (
        theirs.num_key_value_heads, theirs.max_position_embeddings, theirs.rms_norm_eps)
    assert ours.head_dim == (getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads)
    if model_type == "qwen2":
        assert ours.layer_windows == [16 if i >= theirs.max_window_layers else None for i in range(30)]
    if model_type == "mistral":
        assert set(ours.layer_windows) == {theirs.sliding_window}


def test_an_mlp_activation_other_than_silu_is_refused_naming_it():
    """Every layer's MLP computes SiLU: a config with another ``hidden_act`` (transformers runs
    ``gelu`` there) loaded and answered wrongly, without a word."""
    base = json.loads(hf_config("llama").to_json_string()) | {"architectures": ["LlamaForCausalLM"]}
    assert ModelConfig.from_dict(base | {"hidden_act": "swish"}).hidden_size == base["hidden_size"]
    with pytest.raises(ModelLoadError, match="hidden_act 'gelu' is not supported"):
        ModelConfig.from_dict(base | {"hidden_act": "gelu"})


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("mistral", {"sliding_window": 12}),
        # Only layer 1 slides (max_window_layers); Qwen2 without use_sliding_window ignores it.
        ("qwen2", {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1}),
        ("qwen2", {"use_sliding_window": False, "sliding_window": 12}),
    ],
)
def test_sliding_window_attention_matches_transformers_past_the_window(tmp_path, arch, overrides, native):
    """Prompts and generations longer than the window, chunked across it: the window is
    applied (it used to cap the context instead), on the CPU kernels and on gather + SDPA."""
    from engine import native_kernels

    model = build_checkpoint(arch, tmp_path, **overrides)
    config = ModelConfig.from_model_dir(tmp_path)
    windows = {"mistral": [12, 12], "qwen2": [None, 12] if overrides.get("use_sliding_window") else [None, None]}[arch]
    assert config.layer_windows == windows
    prompts = random_prompts([7, 30, 45], model.config.vocab_size, seed=4)
    engine = LLMEngine(tmp_path, EngineConfig(num_kv_blocks=64, long_prefill_chunk=16, max_num_batched_tokens=64, attention_backend="auto" if native else "sdpa"))
    assert engine.max_model_len == model.config.max_position_embeddings
    assert (engine.runner.attention.name == "cpu") == (native and native_kernels.kernel() is not None)
    got = [c.token_ids for c in engine.generate(prompts, GREEDY)]
    assert got == [hf_greedy(model, p, 10) for p in prompts]


def test_loading_a_model_does_not_import_the_compiler_stack(checkpoints):
    """Every worker process loads a model as it starts: building it must not pull in
    torch._dynamo and sympy (about 2 s of CPU each; nn.Embedding's random init on the meta
    device did). Checked in a fresh interpreter, where nothing else has imported them."""
    path, _ = checkpoints["llama"]
    probe = (
        "import sys, torch\n"
        "from engine import EngineConfig, LLMEngine, SamplingParams\n"
        f"engine = LLMEngine({str(path)!r}, EngineConfig(num_kv_blocks=16, num_threads=1))\n"
        "engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.8, top_p=0.9, seed=1))\n"
        "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout


def test_workers_copying_kv_blocks_agree_on_the_weights_and_the_rotary_schedule(tmp_path, checkpoints):
    """KV blocks mean the same in two workers only if the same weights computed them with the
    same rotation: the compatibility check compared the config.json and shapes, so a fine-tune
    with its base's config (or a dynamic-NTK model started with another max_model_len) passed, and
    its blocks decoded to garbage. The weights' digest reads whole tensors from the files: a
    sharded and an unsharded copy agree, whatever dtype the engines run in."""
    from kvtransfer.errors import IncompatiblePeerError
    from kvtransfer.handshake import check_offer
    from kvtransfer.layout import KVCompat
    from engine.loader import weights_digest

    base, _ = checkpoints["llama"]  # saved sharded
    build_checkpoint("llama", tmp_path / "whole", seed=0)
    build_checkpoint("llama", tmp_path / "tuned", seed=1)
    assert weights_digest(base) == weights_digest(tmp_path / "whole")
    assert weights_digest(tmp_path / "tuned") != weights_digest(base)

    def compat(path, **config):
        return KVCompat(**LLMEngine(path, EngineConfig(num_kv_blocks=16, **config)).kv_compat_fields())

    ours, tuned = compat(base), compat(tmp_path / "tuned")
    assert compat(base, dtype="bfloat16", kv_cache_dtype="int8").weights == compat(base, kv_cache_dtype="int8").weights
    assert (tuned.weights != ours.weights) and (tuned.model_id, tuned.rope) == (ours.model_id, ours.rope)  # same config.json
    from kvtransfer.handshake import PROTOCOL_VERSION

    offer = SimpleNamespace(protocol_version=PROTOCOL_VERSION, compat=tuned, compat_hash=tuned.compat_hash(), transport="ray", peer="D")
    with pytest.raises(IncompatiblePeerError, match="weights"):
        check_offer(ours, "ray", offer, [])
    build_checkpoint("llama", tmp_path / "dynamic", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert compat(tmp_path / "dynamic", max_model_len=256).rope != compat(tmp_path / "dynamic", max_model_len=1024).rope
    assert compat(base, max_model_len=256).rope == compat(base, max_model_len=1024).rope  # llama3's does not depend on it
