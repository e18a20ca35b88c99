"""Small random-weight Hugging Face checkpoints of each supported architecture, for tests.

Weights are drawn with a larger init scale than transformers' default so logits are far
apart: greedy comparisons then test the engine, not float rounding between near-ties.
"""

from __future__ import annotations

from pathlib import Path

import torch

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")

_COMMON = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.15,
    bos_token_id=1,
    eos_token_id=2,
)


def hf_config(arch: str, **overrides):
    """A transformers config of ``arch`` exercising that family's distinctive features."""
    import transformers

    fields = dict(_COMMON)
    if arch == "llama":
        cls = transformers.LlamaConfig
        fields["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        }
    elif arch == "mistral":
        cls = transformers.MistralConfig
        fields.update(sliding_window=None, tie_word_embeddings=True)
        fields["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    elif arch == "qwen2":
        cls = transformers.Qwen2Config
        fields.update(tie_word_embeddings=True, num_key_value_heads=1)
    elif arch == "qwen3":
        cls = transformers.Qwen3Config
        fields.update(head_dim=32, tie_word_embeddings=False)
    else:
        raise ValueError(f"unknown test architecture {arch!r}")
    fields.update(overrides)
    return cls(**fields)


def build_checkpoint(arch: str, path: Path, seed: int = 0, dtype: torch.dtype = torch.float32, max_shard_size: str | None = None, **overrides):
    """Save a random-weight model of ``arch`` to ``path``; return the transformers model (float32, eval)."""
    import transformers

    torch.manual_seed(seed)
    config = hf_config(arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        # Visible biases, so a loader that drops them fails the comparison.
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    saved = model.to(dtype) if dtype != torch.float32 else model
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    saved.save_pretrained(path, **kwargs)
    return model.float()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy continuation of ``prompt``, ignoring EOS."""
    ids = torch.tensor([prompt])
    model.generation_config.eos_token_id = None  # run to max_new_tokens, like ignore_eos
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]



def exact_top_k_sequences(model, prompt: list[int], num_tokens: int, temperature: float, top_k: int) -> dict[tuple[int, ...], float]:
    """Every continuation of ``num_tokens`` tokens that sampling with ``temperature`` and ``top_k``
    can draw after ``prompt``, with its exact probability under transformers' model."""

    def filtered(logits: torch.Tensor) -> torch.Tensor:
        scaled = logits / temperature
        kth = scaled.topk(top_k).values[-1]
        return torch.softmax(scaled.masked_fill(scaled < kth, float("-inf")), dim=-1)

    frontier = {(): 1.0}
    with torch.no_grad():
        for _ in range(num_tokens):
            grown = {}
            for prefix, prob in frontier.items():
                probs = filtered(model(torch.tensor([prompt + list(prefix)])).logits[0, -1])
                for token in probs.nonzero().flatten().tolist():
                    grown[prefix + (token,)] = prob * float(probs[token])
            frontier = grown
    return frontier


def assert_drawn_like(outcomes: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> None:
    """Each outcome's frequency within four standard errors of its exact probability."""
    counts: dict[tuple[int, ...], int] = {}
    for outcome in outcomes:
        counts[outcome] = counts.get(outcome, 0) + 1
    assert set(counts) <= set(exact), "an outcome sampling cannot produce"
    draws = len(outcomes)
    for outcome, p in exact.items():
        freq = counts.get(outcome, 0) / draws
        assert abs(freq - p) <= 4 * (p * (1 - p) / draws) ** 0.5 + 2e-3, (outcome, freq, p)


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_lora_adapter(base_model, path: Path, seed: int, targets=LORA_TARGETS, rank: int = 8, alpha: float = 16.0, **config_fields):
    """Save a PEFT LoRA adapter for ``base_model`` (its B matrices random, not PEFT's zeros, so it
    changes what the model computes) to ``path``; return PEFT's model of base plus adapter (eval)."""
    import copy

    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False, **config_fields)
    adapted = peft.get_peft_model(copy.deepcopy(base_model), config).eval()
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.mul_(0.5)  # a delta that moves greedy choices without swamping the base model
    adapted.save_pretrained(path)
    return adapted
