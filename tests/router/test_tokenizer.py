"""The router's tokenizer gives the same ids and text as transformers.AutoTokenizer."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors

from router.tokenizer import Tokenizer, TokenizerLoadError
from tests.router.tokenizer_builders import BASE_CONFIG, BOS_TEMPLATE, save_model_dir

TEXTS = [
    "Hello world",
    "東京 😀 déjà vu, naïve!",
    "👨‍👩‍👧 family 🇯🇵",
    "",
    "  leading and trailing spaces  ",
    "special tokens inline: <s>in the middle</s> and <pad>",
    "unseen script: ᚠᛇᚻ ✓ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "line one\n\nline two\twith tab",
]

BYTE_LEVEL = processors.ByteLevel(trim_offsets=False)
# (name, tokenizer.json post-processor, tokenizer_config.json or None)
VARIANTS = [
    ("bos_from_template", BOS_TEMPLATE, BASE_CONFIG),
    ("no_bos_post_processor", BYTE_LEVEL, BASE_CONFIG),
    # transformers v5 ignores add_bos_token/add_eos_token when tokenizer.json exists
    ("config_asks_bos_template_has_none", BYTE_LEVEL, {**BASE_CONFIG, "add_bos_token": True}),
    ("config_refuses_bos_template_adds_it", BOS_TEMPLATE, {**BASE_CONFIG, "add_bos_token": False, "add_eos_token": True}),
    ("no_post_processor", None, BASE_CONFIG),
    ("no_tokenizer_config", BOS_TEMPLATE, None),
    (
        "special_tokens_missing_from_tokenizer_json",
        BOS_TEMPLATE,
        {
            **BASE_CONFIG,
            "pad_token": {"__type": "AddedToken", "content": "<|pad|>", "special": True},
            "additional_special_tokens": ["<|tool|>", "<|x|>"],
        },
    ),
]


@pytest.fixture(scope="module")
def auto_tokenizer():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained


@pytest.mark.parametrize(("name", "post_processor", "config"), VARIANTS, ids=[v[0] for v in VARIANTS])
def test_encode_and_decode_match_transformers(
    tmp_path, byte_level_backend, auto_tokenizer, name, post_processor, config
):
    backend = BackendTokenizer.from_str(byte_level_backend.to_str())
    backend.post_processor = post_processor
    model_dir = save_model_dir(tmp_path / name, backend, config)
    ours = Tokenizer.from_model_dir(model_dir)
    theirs = auto_tokenizer(model_dir)
    assert ours.vocab_size == len(theirs)
    extra = ["<|pad|> and <|tool|> and <|x|>"] if "missing" in name else []
    for text in TEXTS + extra:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text


def test_bos_and_eos_ids_come_from_the_config(byte_level_tokenizer):
    assert byte_level_tokenizer.bos_token_id == byte_level_tokenizer.token_to_id("<s>")
    assert byte_level_tokenizer.eos_token_id == byte_level_tokenizer.token_to_id("</s>")
    assert byte_level_tokenizer.encode("hi")[0] == byte_level_tokenizer.bos_token_id


def test_wordpiece_cleanup_matches_transformers(wordpiece_cleanup_dir, auto_tokenizer):
    ours = Tokenizer.from_model_dir(wordpiece_cleanup_dir)
    theirs = auto_tokenizer(wordpiece_cleanup_dir)
    assert ours.cleans_up_spaces
    for text in ["It's 3:45 pm , isn't it ?", "The fox . The dog !", *TEXTS]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


def test_missing_or_broken_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerLoadError, match="no tokenizer.json"):
        Tokenizer.from_model_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerLoadError, match="cannot be loaded"):
        Tokenizer.from_model_dir(tmp_path)


@pytest.mark.parametrize("build", ["byte_level", "byte_fallback"])
def test_logprob_bytes_of_a_characters_tokens_join_into_the_character(tmp_path, build):
    """OpenAI's logprobs ``bytes`` exist so that a client can join the tokens of one character
    (each alone decodes to U+FFFD); they were the replacement character's own bytes."""
    from router.openai_api.responses import _token_bytes
    from tests.router.tokenizer_builders import build_byte_fallback_bpe, train_byte_level_bpe

    backend = train_byte_level_bpe() if build == "byte_level" else build_byte_fallback_bpe()
    tokenizer = Tokenizer.from_model_dir(save_model_dir(tmp_path, backend, BASE_CONFIG))
    text = "a😀bü€漢字x"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "some token must hold part of a character"
    joined = b"".join(bytes(_token_bytes(i, tokenizer)) for i in ids)
    assert joined == text.encode("utf-8")


def test_an_added_tokens_decoder_that_disagrees_with_tokenizer_json_is_applied_as_transformers_does(tmp_path, byte_level_backend, auto_tokenizer):
    """tokenizer_config.json calls a token special that tokenizer.json does not (or strips
    another differently): transformers v5 adds it again as the config writes it, so a decode
    that skips special tokens hid it there and showed it here ("<tool_call>" left in an answer
    transformers and vLLM give without it), and prompts split differently around it."""
    from tokenizers import AddedToken

    backend = BackendTokenizer.from_str(byte_level_backend.to_str())
    backend.post_processor = BOS_TEMPLATE
    backend.add_tokens([AddedToken("<tool_call>", special=False, normalized=False)])
    backend.add_special_tokens([AddedToken("<|end|>", special=True, normalized=False)])
    entry = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    decoder = {
        str(backend.token_to_id("<tool_call>")): {**entry, "content": "<tool_call>"},
        str(backend.token_to_id("<|end|>")): {**entry, "content": "<|end|>", "lstrip": True},
        str(backend.token_to_id("<s>")): {**entry, "content": "<s>"},
    }
    backend.add_tokens([AddedToken("<|pad|>", special=False, normalized=False)])
    decoder[str(backend.token_to_id("<|pad|>"))] = {**entry, "content": "<|pad|>", "special": False}  # the pad token: special whatever this says
    model_dir = save_model_dir(tmp_path / "decoder", backend, {**BASE_CONFIG, "pad_token": "<|pad|>", "added_tokens_decoder": decoder})
    ours, theirs = Tokenizer.from_model_dir(model_dir), auto_tokenizer(model_dir)
    texts = ["Checking. <tool_call> {} then <|end|>", "a  <|end|>b<tool_call>c<|pad|>", *TEXTS]
    assert ours.vocab_size == len(theirs)
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
    assert "<tool_call>" not in ours.decode(ours.encode(texts[0]), skip_special_tokens=True)
    assert "<|pad|>" not in ours.decode(ours.encode(texts[1]), skip_special_tokens=True)
