"""A Hugging Face model directory's fast tokenizer, loaded with the ``tokenizers`` library.

The router must produce the same prompt ids as ``transformers.AutoTokenizer`` (the model was
trained and is tested against those), without depending on transformers at run time. What
transformers (v5, ``TokenizersBackend``) does on top of ``tokenizer.json``, and we mirror:

- ``tokenizer_config.json``'s ``added_tokens_decoder`` is applied where it disagrees with
  ``tokenizer.json``'s added tokens (a token special there and not here, another side stripped):
  such a token is added again as the config writes it;
- special tokens named in ``tokenizer_config.json`` / ``special_tokens_map.json`` that are not
  yet added tokens are added as special tokens;
- BOS/EOS come from tokenizer.json's post-processor alone: transformers v5 drops the config's
  ``add_bos_token`` / ``add_eos_token`` whenever tokenizer.json exists (v4 honoured them for
  some classes). A config that disagrees with the post-processor is logged as a warning,
  since such a model may have been trained with the other behaviour;
- decode applies ``clean_up_tokenization_spaces`` only for non-BPE models (transformers skips
  it for BPE, where it would corrupt text) unless the config forces it.

Model-specific tokenizer classes that rebuild the backend from scratch in transformers are not
mirrored; ``tokenizer_class`` is logged so a mismatch is easy to spot.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

logger = logging.getLogger(__name__)

_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_EXTRA_SPECIAL_TOKEN_KEYS = ("additional_special_tokens", "extra_special_tokens")
_FORCE_BPE_CLEANUP_KEY = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback vocabulary's byte token


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character to byte: printable Latin-1 bytes stand for
    themselves, the other 68 for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {chr(byte): byte for byte in printable}
    others = (byte for byte in range(256) if chr(byte) not in chars)
    chars.update({chr(256 + n): byte for n, byte in enumerate(others)})
    return chars


_BYTE_LEVEL_CHARS = _byte_level_chars()


class TokenizerLoadError(Exception):
    """A model directory has no usable tokenizer."""


class Tokenizer:
    """Encode prompts and decode outputs exactly as the model's Hugging Face tokenizer does."""

    def __init__(self, backend: BackendTokenizer, config: dict[str, Any]) -> None:
        self._backend = backend
        self._config = config
        self._special_ids: frozenset[int] | None = None  # what a decode skips (made when first asked)
        named = {key: _token_content(config.get(key)) for key in _NAMED_SPECIAL_TOKENS}
        # What a chat template sees as bos_token, eos_token, ... (transformers' special_tokens_map).
        self.special_tokens_map = {key: content for key, content in named.items() if content is not None}
        # The model's chat templates by name: "default", and "tool_use" where a model renders
        # requests with tools by a template of their own (Hermes-2-Pro's, Hermes-3's).
        self.chat_templates: dict[str, str] = _named_templates(config.get("chat_template"))
        self._apply_added_tokens_decoder(config.get("added_tokens_decoder"), {content for content in named.values() if content is not None})
        self._add_missing_special_tokens([*named.values(), *_extra_special_tokens(config)])
        self.bos_token_id = self._token_id(named["bos_token"])
        self.eos_token_id = self._token_id(named["eos_token"])
        is_bpe = type(backend.model).__name__ == "BPE"
        self.cleans_up_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and (
            not is_bpe or bool(config.get(_FORCE_BPE_CLEANUP_KEY, False))
        )

    @property
    def chat_template(self) -> str | None:
        """The template a chat without tools renders by (None: the model has none)."""
        return self.chat_templates.get("default")

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` plus ``tokenizer_config.json`` / ``special_tokens_map.json`` if present."""
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerLoadError(f"{model_dir} has no tokenizer.json (only fast tokenizers are supported)")
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises a bare Exception on a malformed file
            raise TokenizerLoadError(f"{tokenizer_file} cannot be loaded: {exc}") from exc
        config = _read_json(model_dir / "special_tokens_map.json")
        # tokenizer_config.json wins where both name a token, as in transformers.
        config.update(_read_json(model_dir / "tokenizer_config.json"))
        tokenizer = cls(backend, config)
        # Where transformers v5 saves them (they win over the config's): the default template,
        # and the others by name.
        template_file = model_dir / "chat_template.jinja"
        if template_file.is_file():
            tokenizer.chat_templates["default"] = template_file.read_text(encoding="utf-8")
        for named_file in sorted((model_dir / "additional_chat_templates").glob("*.jinja")):
            tokenizer.chat_templates[named_file.name.removesuffix(".jinja")] = named_file.read_text(encoding="utf-8")
        tokenizer._warn_if_config_disagrees(model_dir)
        logger.info(
            "loaded tokenizer from %s (class %s, %d tokens, bos=%s, eos=%s)",
            model_dir, config.get("tokenizer_class", "unspecified"), tokenizer.vocab_size,
            tokenizer.bos_token_id, tokenizer.eos_token_id,
        )
        return tokenizer

    @property
    def vocab_size(self) -> int:
        """Number of tokens including added ones (``len()`` of a transformers tokenizer)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, with BOS/EOS added as the model's tokenizer config says.

        Through ``encode_batch``: unlike ``encode`` it releases the GIL while it works, so a
        megabyte prompt tokenized on a thread does not stall the router's event loop (measured:
        a 3.6 MB text, 4.4 s holding the GIL through ``encode``).
        """
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids`` as transformers' ``decode`` returns it."""
        text = self.decode_raw(token_ids, skip_special_tokens)
        return clean_up_tokenization(text) if self.cleans_up_spaces else text

    def decode_raw(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The backend decoder's text, before transformers' space clean-up (for incremental decoding)."""
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def writes_any(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> bool:
        """Whether the decoder takes any of these tokens in (a skipped special token it does not),
        whether or not they write text."""
        if not skip_special_tokens:
            return bool(token_ids)
        if self._special_ids is None:
            self._special_ids = frozenset(i for i, added in self._backend.get_added_tokens_decoder().items() if added.special)
        return any(token_id not in self._special_ids for token_id in token_ids)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary's piece for ``token_id`` (byte-level "Ġhi", SentencePiece "▁hi"), as
        transformers' ``convert_ids_to_tokens`` names it; None for an id past the vocabulary."""
        return self._backend.id_to_token(token_id)

    @functools.cached_property
    def _decoder_kind(self) -> str:
        """How the vocabulary writes bytes: "byte_level" (GPT-2, Llama 3, Qwen), "byte_fallback"
        (SentencePiece's <0xNN> tokens: Llama 2, Mistral), or "" (neither)."""
        decoder = self._backend.decoder
        state = decoder.__getstate__().decode() if decoder is not None else ""
        return "byte_level" if '"ByteLevel"' in state else "byte_fallback" if '"ByteFallback"' in state else ""

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes one token stands for, where the vocabulary says (a token holding part of a
        character has no text of its own: its decoding is U+FFFD); None where it does not."""
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return None
        if self._decoder_kind == "byte_level" and all(c in _BYTE_LEVEL_CHARS for c in piece):
            return bytes(_BYTE_LEVEL_CHARS[c] for c in piece)
        if self._decoder_kind == "byte_fallback" and (byte := _BYTE_PIECE.fullmatch(piece)):
            return bytes([int(byte.group(1), 16)])
        return None

    def _token_id(self, content: str | None) -> int | None:
        return None if content is None else self._backend.token_to_id(content)

    def _warn_if_config_disagrees(self, model_dir: Path) -> None:
        added = self._backend.encode("", add_special_tokens=True).ids
        for key, token_id in (("add_bos_token", self.bos_token_id), ("add_eos_token", self.eos_token_id)):
            wanted = self._config.get(key)
            if isinstance(wanted, bool) and token_id is not None and wanted != (token_id in added):
                logger.warning(
                    "%s/tokenizer_config.json sets %s=%s but tokenizer.json's post-processor %s it; "
                    "following tokenizer.json, as transformers v5 does",
                    model_dir, key, wanted, "does not add" if wanted else "adds",
                )

    def _apply_added_tokens_decoder(self, entries: Any, named: set[str]) -> None:
        """Add again, as the config writes them, the config's added tokens that tokenizer.json
        holds otherwise (or not at all), as transformers v5 does: one the config calls special
        and tokenizer.json does not was left in decoded text that transformers (and vLLM through
        it) skips, and one stripped on another side split prompts differently. A named special
        token (``named``: bos, eos, pad, ...) is special whatever the entry says, as there."""
        if not isinstance(entries, dict):
            return
        held = {repr(token) for token in self._backend.get_added_tokens_decoder().values()}
        tokens = []
        for _, entry in sorted(entries.items(), key=lambda item: _as_int(item[0])):
            if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
                continue
            flags = {key: bool(entry[key]) for key in ("single_word", "lstrip", "rstrip", "normalized", "special") if key in entry}
            if entry["content"] in named:
                flags["special"] = True
            token = AddedToken(entry["content"], **flags)
            if repr(token) not in held:
                tokens.append(token)
        if tokens:
            self._backend.add_tokens(tokens)  # each keeps its own special flag
            logger.info("tokenizer_config.json's added_tokens_decoder re-applied to %d token(s) tokenizer.json holds otherwise: %s",
                        len(tokens), ", ".join(repr(token.content) for token in tokens[:8]))

    def _add_missing_special_tokens(self, contents: list[str | None]) -> None:
        # Checked against added tokens, not the vocabulary: like transformers, a special token that
        # only exists as an ordinary vocabulary entry becomes an added special token, so it is
        # matched whole in text and skipped when decoding.
        added = {token.content for token in self._backend.get_added_tokens_decoder().values()}
        missing = [c for c in dict.fromkeys(contents) if c is not None and c not in added]
        if missing:
            self._backend.add_special_tokens([AddedToken(c, special=True, normalized=False) for c in missing])


def _as_int(key: Any) -> int:
    """An added_tokens_decoder key's id (one that is none sorts first)."""
    try:
        return int(key)
    except (TypeError, ValueError):
        return -1


# transformers' replacements, applied in this order; each replaced pattern starts with a space
# and is at most 4 characters long, which bounds how far back appended text can change output.
_CLEANUP_REPLACEMENTS = (
    (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
    (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
)
# A replacement pass can only change its output within (pattern length - 1) characters of the
# input's end when more input is appended; chained passes add up.
CLEANUP_UNSTABLE_TAIL = sum(len(pattern) - 1 for pattern, _ in _CLEANUP_REPLACEMENTS)


def clean_up_tokenization(text: str) -> str:
    """Remove spaces before punctuation and contractions, as transformers' clean-up does."""
    for pattern, replacement in _CLEANUP_REPLACEMENTS:
        text = text.replace(pattern, replacement)
    return text


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerLoadError(f"{path} cannot be read: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerLoadError(f"{path} must hold a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """A config's token entry is either the token text or an AddedToken dict with ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _extra_special_tokens(config: dict[str, Any]) -> list[str | None]:
    tokens: list[str | None] = []
    for key in _EXTRA_SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        # transformers v5 also accepts a {name: token} mapping here.
        entries = value.values() if isinstance(value, dict) else value or []
        tokens.extend(_token_content(entry) for entry in entries)
    return tokens


def _named_templates(value: Any) -> dict[str, str]:
    """tokenizer_config.json's ``chat_template`` by name: the text alone is the default; a list
    names each of its templates."""
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        entries = (entry for entry in value if isinstance(entry, dict))
        return {entry["name"]: entry["template"] for entry in entries if isinstance(entry.get("name"), str) and isinstance(entry.get("template"), str)}
    return {}
