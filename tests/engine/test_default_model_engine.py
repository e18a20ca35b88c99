"""The built-in default model runs in the engine exactly as in transformers."""

from __future__ import annotations

import pytest
import torch

from engine import DEFAULT_MODEL_PATH, EngineConfig, LLMEngine, SamplingParams
from router.tokenizer import Tokenizer

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def __init__(self):", "for i in range(10):\n    "]


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_PATH, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model, AutoTokenizer.from_pretrained(DEFAULT_MODEL_PATH)


@pytest.mark.parametrize("chunk", [7, None])
def test_engine_greedy_equals_transformers_on_the_default_model(reference, chunk):
    model, hf_tokenizer = reference
    tokenizer = Tokenizer.from_model_dir(DEFAULT_MODEL_PATH)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    assert prompts == [hf_tokenizer(p)["input_ids"] for p in PROMPTS], "router tokenization matches transformers"
    expected = []
    for ids in prompts:
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=24, do_sample=False, pad_token_id=0)
        expected.append(out[0, len(ids):].tolist())
    engine = LLMEngine(config=EngineConfig(dtype="float32", num_kv_blocks=128, long_prefill_chunk=chunk))
    assert engine.model_path == DEFAULT_MODEL_PATH, "the default model is the engine's default"
    results = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert [r.token_ids for r in results] == expected
