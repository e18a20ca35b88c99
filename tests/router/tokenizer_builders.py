"""Small tokenizers trained in memory in well under a second, saved as Hugging Face model directories."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

# Mixed scripts so that the trained vocabulary has multi-byte characters both as single tokens
# and split over several byte tokens (rare characters keep their raw bytes).
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 3:45 pm, isn't it?",
    "Café déjà vu: a naïve façade in Ærøskøbing, São Paulo and Kraków.",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "Emoji 😀😃😄 thumbs 👍🏽 flags 🇯🇵🇫🇷 family 👨‍👩‍👧 hearts ❤️💙.",
    "Привет, мир! Γειά σου Κόσμε! مرحبا بالعالم. שלום עולם.",
    "def main():\n    return {'key': [1, 2, 3]}  # code\n\n",
]
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
BOS_TEMPLATE = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)])
BASE_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}


def train_byte_level_bpe(vocab_size: int = 400) -> BackendTokenizer:
    """A GPT-2/Llama-3 style byte-level BPE tokenizer with a BOS-adding post-processor."""
    tokenizer = BackendTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    tokenizer.post_processor = BOS_TEMPLATE
    return tokenizer


def train_metaspace_bpe() -> BackendTokenizer:
    """A SentencePiece-style tokenizer: '▁' marks spaces, the decoder strips the first one."""
    tokenizer = BackendTokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", *SPECIAL_TOKENS], show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
    )
    return tokenizer


def build_byte_fallback_bpe() -> BackendTokenizer:
    """A Llama-2/Mistral style tokenizer: characters outside the vocabulary become <0xNN> byte tokens."""
    pieces = ["<unk>", *SPECIAL_TOKENS, *(f"<0x{b:02X}>" for b in range(256)), "▁", "é", "à"]
    pieces += [chr(c) for c in range(33, 127)] + [f"▁{chr(c)}" for c in range(33, 127)]
    vocab = {piece: index for index, piece in enumerate(dict.fromkeys(pieces))}
    tokenizer = BackendTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return tokenizer


def train_wordpiece() -> BackendTokenizer:
    """A BERT-style WordPiece tokenizer: the non-BPE case where transformers cleans up spaces."""
    tokenizer = BackendTokenizer(models.WordPiece(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(cleanup=False)
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["<unk>", *SPECIAL_TOKENS], show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    return tokenizer


def save_model_dir(directory: Path, backend: BackendTokenizer, config: dict | None) -> Path:
    """Write tokenizer.json (and tokenizer_config.json unless config is None) into directory."""
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory
