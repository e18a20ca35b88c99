"""Saving a trained ``tokenizers`` tokenizer as a Hugging Face fast tokenizer (shared by the tools)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast


def save_fast_tokenizer(tokenizer: Tokenizer, out: Path, eot: str, max_length: int) -> None:
    """Write tokenizer.json and its config so that transformers 4 and 5 both load it."""
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=eot,
        eos_token=eot,
        pad_token=eot,
        model_max_length=max_length,
        # transformers' clean-up would delete the space in "x ." and similar, corrupting code.
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out)
    # transformers 5 records its own backend class name, which 4.x cannot resolve; the generic
    # fast class loads the same tokenizer.json in both.
    config_path = Path(out) / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")
