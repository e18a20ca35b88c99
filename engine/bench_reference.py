"""The engine benchmark's outside reference: transformers' own eager forward with a static cache.

What a careful transformers user gets on the same checkpoint, dtype and threads: SDPA
attention, a ``StaticCache`` (no per-step cache growth), greedy argmax per decode step, and
a prefill that computes logits for the last position only (``logits_to_keep=1``, as
``generate`` does). Decode timing does not depend on what the cache holds, so the cache is
advanced to the context length without computing a prompt, as the engine's side does too.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch


class TransformersReference:
    """One ``LlamaForCausalLM`` (or sibling) loaded through transformers, timed like the engine."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, lora_adapters: dict[str, Path] | None = None):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").eval()
        self.dtype = dtype
        if lora_adapters:
            # PEFT's own LoRA serving: every adapter loaded, a batch's rows picked by the forward's
            # ``adapter_names`` (PEFT's mixed-adapter batches).
            import peft

            names = list(lora_adapters)
            self.model = peft.PeftModel.from_pretrained(self.model, lora_adapters[names[0]], adapter_name=names[0]).eval()
            for name in names[1:]:
                self.model.load_adapter(lora_adapters[name], adapter_name=name)

    def _static_cache(self, batch: int, max_len: int):
        from transformers import StaticCache

        cache = StaticCache(config=self.model.config, max_cache_len=max_len)
        # Initialise every layer's buffers with one token, then rewind: the timed steps never
        # pay for the lazy allocation.
        with torch.inference_mode():
            self.model(input_ids=torch.zeros((batch, 1), dtype=torch.long), past_key_values=cache, use_cache=True)
        return cache

    @staticmethod
    def _seek(cache, length: int) -> None:
        for layer in cache.layers:
            layer.cumulative_length.fill_(length)

    @torch.inference_mode()
    def decode_tok_s(self, batch: int, context: int, steps: int, **forward) -> float:
        """Greedy decode tokens/s of ``batch`` sequences that already hold ``context`` tokens
        (``forward``: more arguments of each forward, e.g. PEFT's ``adapter_names``)."""
        cache = self._static_cache(batch, context + steps + 2)
        self._seek(cache, context)
        tokens = torch.full((batch, 1), 5, dtype=torch.long)

        def one_step(position: int) -> torch.Tensor:
            positions = torch.full((batch, 1), position, dtype=torch.long)
            out = self.model(input_ids=tokens, position_ids=positions, past_key_values=cache, use_cache=True, **forward)
            return out.logits[:, -1].argmax(dim=-1, keepdim=True)

        tokens = one_step(context)  # warm-up
        start = time.perf_counter()
        for i in range(steps):
            tokens = one_step(context + 1 + i)
        return batch * steps / (time.perf_counter() - start)

    @torch.inference_mode()
    def prefill_tok_s(self, prompt: list[int], **forward) -> float:
        """Tokens/s of one forward over the whole prompt into an empty static cache."""
        cache = self._static_cache(1, len(prompt))
        input_ids = torch.tensor([prompt], dtype=torch.long)
        self._seek(cache, 0)
        self.model(input_ids=input_ids[:, :64], past_key_values=cache, use_cache=True, logits_to_keep=1, **forward)  # warm-up
        self._seek(cache, 0)
        start = time.perf_counter()
        self.model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1, **forward)
        return len(prompt) / (time.perf_counter() - start)

    @torch.inference_mode()
    def score_tok_s(self, prompt: list[int], num_top: int) -> float:
        """Tokens/s of scoring the prompt as a loglikelihood client does with transformers: one
        forward with every position's logits, their log-softmax, each next token's
        log-probability and rank, and the ``num_top`` most likely."""
        input_ids = torch.tensor([prompt], dtype=torch.long)
        self.model(input_ids=input_ids[:, :64])  # warm-up
        start = time.perf_counter()
        log_probs = torch.log_softmax(self.model(input_ids=input_ids).logits[0, :-1].float(), dim=-1)
        chosen = log_probs.gather(1, input_ids[0, 1:].unsqueeze(1))
        (log_probs > chosen).sum(dim=-1).tolist()
        log_probs.topk(num_top, dim=-1).values.tolist()
        return len(prompt) / (time.perf_counter() - start)
