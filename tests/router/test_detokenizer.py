"""Streaming text: concatenated deltas equal the full decode, and no delta splits a character."""

from __future__ import annotations

import random

import pytest

from router.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from router.tokenizer import Tokenizer

MULTIBYTE_TEXTS = [
    "東京は日本の首都です。北京是中国的首都。",
    "Emoji 😀😃😄 👍🏽 🇯🇵🇫🇷 👨‍👩‍👧 ❤️💙 done.",
    "Café déjà vu: naïve façade in Ærøskøbing, Kraków.",
    "Mixed: hello 世界 🌍 Привет γειά שלום ᚠᛇᚻ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 end",
    "",
]


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int], batch_sizes: list[int]) -> list[str]:
    """Feed token_ids in batches of the given sizes; return the deltas including finish()."""
    deltas, start = [], 0
    for size in batch_sizes:
        deltas.append(detokenizer.add_tokens(token_ids[start : start + size]))
        start += size
    deltas.append(detokenizer.add_tokens(token_ids[start:]))
    deltas.append(detokenizer.finish())
    return deltas


def random_batches(rng: random.Random, n: int) -> list[int]:
    sizes = []
    while sum(sizes) < n:
        sizes.append(rng.randint(1, 5))
    return sizes


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_token_by_token_equals_full_decode_and_never_splits_a_character(byte_level_tokenizer, text):
    token_ids = byte_level_tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_level_tokenizer)
    seen_partial_tokens = False
    for i, token_id in enumerate(token_ids):
        delta = detok.add_tokens([token_id])
        assert REPLACEMENT_CHAR not in delta
        # Held back only while a character is incomplete: everything decodable is already out.
        prefix = byte_level_tokenizer.decode(token_ids[: i + 1])
        assert detok.text == prefix.rstrip(REPLACEMENT_CHAR)
        seen_partial_tokens |= prefix.endswith(REPLACEMENT_CHAR)
    assert detok.text + detok.finish() == byte_level_tokenizer.decode(token_ids) == text
    if text.startswith("東京"):
        assert seen_partial_tokens, "the fixture should split some CJK characters over several tokens"


@pytest.mark.parametrize("seed", range(20))
def test_random_batches_of_multibyte_text(byte_level_tokenizer, seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(MULTIBYTE_TEXTS[:-1]) for _ in range(4))
    token_ids = byte_level_tokenizer.encode(text, add_special_tokens=False)
    deltas = stream(IncrementalDetokenizer(byte_level_tokenizer), token_ids, random_batches(rng, len(token_ids)))
    assert "".join(deltas) == text
    assert all(REPLACEMENT_CHAR not in d for d in deltas)


@pytest.mark.parametrize("seed", range(20))
def test_random_token_ids_including_invalid_utf8(byte_level_tokenizer, seed):
    # A sampled model can emit byte tokens that never form a valid character; the stream must
    # still equal the full decode, replacement characters and all.
    rng = random.Random(seed)
    token_ids = [rng.randrange(byte_level_tokenizer.vocab_size) for _ in range(rng.randint(1, 60))]
    for skip_special_tokens in (True, False):
        detok = IncrementalDetokenizer(byte_level_tokenizer, skip_special_tokens=skip_special_tokens)
        deltas = stream(detok, token_ids, random_batches(rng, len(token_ids)))
        assert "".join(deltas) == byte_level_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def test_special_tokens_are_skipped_unless_asked_for(byte_level_tokenizer):
    tok = byte_level_tokenizer
    token_ids = [tok.bos_token_id, *tok.encode("déjà 😀", add_special_tokens=False), tok.eos_token_id]
    skipped = stream(IncrementalDetokenizer(tok), token_ids, [1] * len(token_ids))
    kept = stream(IncrementalDetokenizer(tok, skip_special_tokens=False), token_ids, [1] * len(token_ids))
    assert "".join(skipped) == "déjà 😀"
    assert "".join(kept) == "<s>déjà 😀</s>"


@pytest.mark.parametrize("seed", range(5))
def test_leading_space_stripping_decoder_keeps_inner_spaces(metaspace_tokenizer, seed):
    # SentencePiece-style decoders drop the space before the first token only; decoding each
    # token alone would drop every word's space.
    rng = random.Random(seed)
    text = "The quick brown fox jumps over the lazy dog. Café déjà vu in São Paulo, isn't it?"
    token_ids = metaspace_tokenizer.encode(text, add_special_tokens=False)
    deltas = stream(IncrementalDetokenizer(metaspace_tokenizer), token_ids, random_batches(rng, len(token_ids)))
    assert "".join(deltas) == metaspace_tokenizer.decode(token_ids) == text


@pytest.mark.parametrize("seed", range(10))
def test_byte_fallback_tokens_stream_whole_characters(byte_fallback_tokenizer, seed):
    # Llama-2 style: unknown characters are spelled as <0xNN> tokens, and the decoder turns a run
    # of them into text only if the whole run is valid UTF-8.
    tok = byte_fallback_tokenizer
    rng = random.Random(seed)
    text = " ".join(rng.choice(["déjà", "東京", "😀👍🏽", "ok", "€5", "naïve"]) for _ in range(12))
    token_ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(token_ids) == text
    detok = IncrementalDetokenizer(tok)
    for token_id in token_ids:
        assert REPLACEMENT_CHAR not in detok.add_tokens([token_id])
    assert detok.text + detok.finish() == text


@pytest.mark.parametrize("seed", range(10))
def test_leading_space_stripping_decoder_with_special_tokens_in_the_output(metaspace_tokenizer, seed):
    # A skipped special token decodes to nothing, so it cannot serve as the context that
    # absorbs the decoder's first-token space stripping.
    rng = random.Random(seed)
    tok = metaspace_tokenizer
    words = tok.encode("The quick brown fox jumps over the lazy dog and the cat", add_special_tokens=False)
    token_ids = []
    for token_id in words * 3:
        token_ids.append(token_id)
        if rng.random() < 0.3:
            token_ids.append(rng.choice([tok.bos_token_id, tok.eos_token_id]))
    deltas = stream(IncrementalDetokenizer(tok), token_ids, [1] * len(token_ids))
    assert "".join(deltas) == tok.decode(token_ids)


@pytest.mark.parametrize("seed", range(5))
def test_space_cleanup_tokenizer_streams_its_cleaned_decode(wordpiece_cleanup_dir, seed):
    tok = Tokenizer.from_model_dir(wordpiece_cleanup_dir)
    rng = random.Random(seed)
    text = "It 's 3:45 pm , isn 't it ? The fox . The dog ! They 're here ' ok ' . " * 3
    token_ids = tok.encode(text, add_special_tokens=False)
    deltas = stream(IncrementalDetokenizer(tok), token_ids, random_batches(rng, len(token_ids)))
    assert "".join(deltas) == tok.decode(token_ids)
    assert " ." not in "".join(deltas)


def test_long_output_keeps_a_short_decode_window(byte_level_tokenizer):
    calls: list[int] = []

    class CountingTokenizer:
        cleans_up_spaces = False

        def decode_raw(self, token_ids, skip_special_tokens=True):
            calls.append(len(token_ids))
            return byte_level_tokenizer.decode_raw(token_ids, skip_special_tokens)

        def decode(self, token_ids, skip_special_tokens=True):
            return byte_level_tokenizer.decode(token_ids, skip_special_tokens)

    token_ids = byte_level_tokenizer.encode("The quick brown fox. " * 100, add_special_tokens=False)
    detok = IncrementalDetokenizer(CountingTokenizer())
    for token_id in token_ids:
        detok.add_tokens([token_id])
    assert max(calls) <= 12, "per-step decode cost must not grow with the output length"
    assert detok.text + detok.finish() == byte_level_tokenizer.decode(token_ids)  # one whole decode, at the end


def test_finish_is_final(byte_level_tokenizer):
    detok = IncrementalDetokenizer(byte_level_tokenizer, req_id="r1")
    detok.add_tokens(byte_level_tokenizer.encode("hi", add_special_tokens=False))
    detok.finish()
    assert detok.finish() == ""
    with pytest.raises(RuntimeError, match="r1"):
        detok.add_tokens([1])


@pytest.mark.parametrize("kind", ["metaspace", "byte_fallback", "byte_level", "wordpiece_cleanup"])
@pytest.mark.parametrize("seed", range(3))
def test_the_answer_continues_its_prompt_as_transformers_decodes_the_two_together(request, kind, seed):
    """Streamed after its prompt, the answer is what transformers' decode of prompt and answer
    adds to its decode of the prompt: a SentencePiece answer keeps the space before its first
    word (a decoder strips the first token's space only), so ``echo`` joins the two as one text."""
    from transformers import PreTrainedTokenizerFast

    directory = request.getfixturevalue(f"{kind}_dir")
    tok, reference = Tokenizer.from_model_dir(directory), PreTrainedTokenizerFast.from_pretrained(directory)
    rng = random.Random(seed)
    prompt = tok.encode("Café déjà vu: the quick brown fox", add_special_tokens=True)
    answer = tok.encode(" jumps over the lazy dog. It 's 東京, isn't it ?", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    streamed = "".join(stream(detok, answer, random_batches(rng, len(answer))))
    whole, before = reference.decode(prompt + answer, skip_special_tokens=True), reference.decode(prompt, skip_special_tokens=True)
    assert whole.startswith(before) and streamed == whole[len(before) :]
    assert detok.token_ids == answer
    if kind != "wordpiece_cleanup":
        assert streamed.startswith(" jumps")


def _continuation(reference, prompt: list[int], answer: list[int]) -> str:
    """What transformers' decode of prompt and answer adds to its decode of the prompt, a
    character the prompt left unfinished counted as the answer's where the answer finishes it."""
    whole, before = reference.decode(prompt + answer, skip_special_tokens=True), reference.decode(prompt, skip_special_tokens=True)
    if whole.startswith(before):
        return whole[len(before) :]
    unfinished = before.rstrip(REPLACEMENT_CHAR)
    assert whole.startswith(unfinished)
    return whole[len(unfinished) :]


def test_a_short_answer_of_a_cleanup_tokenizer_is_held_until_its_clean_up_is_settled(wordpiece_cleanup_dir):
    """While the cleaned text was shorter than the unstable tail, a negative end let out all but
    its last characters (" ' hi '" sent before the clean-up joined it), and once the sent text
    disagreed with the whole decode, the rest of the answer was dropped."""
    from transformers import PreTrainedTokenizerFast

    tok, reference = Tokenizer.from_model_dir(wordpiece_cleanup_dir), PreTrainedTokenizerFast.from_pretrained(wordpiece_cleanup_dir)
    prompt = tok.encode("Question:", add_special_tokens=True)
    answer = tok.encode("The fox says ' hi ' and then the dog left the house .", add_special_tokens=False)
    streamed = "".join(stream(IncrementalDetokenizer(tok, prompt_token_ids=prompt), answer, [1] * len(answer)))
    assert streamed == _continuation(reference, prompt, answer)
    assert streamed.endswith("house.")


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback"])
def test_a_prompt_of_ids_ending_inside_a_character_lets_the_answer_finish_it(request, kind):
    """A "continue" call whose prompt max_tokens cut inside an emoji: the answer's first tokens
    finish the character (it streamed U+FFFDs, the prompt's bytes never joined to the answer's),
    and where they do not, the prompt's unfinished bytes are not the answer's."""
    from transformers import PreTrainedTokenizerFast

    directory = request.getfixturevalue(f"{kind}_dir")
    tok, reference = Tokenizer.from_model_dir(directory), PreTrainedTokenizerFast.from_pretrained(directory)
    ids = tok.encode("Say hi 😀 ok 東京", add_special_tokens=False)
    unfinished = 0
    for cut in range(1, len(ids)):
        prompt, answer = ids[:cut], ids[cut:]
        unfinished += REPLACEMENT_CHAR in reference.decode(prompt)
        streamed = "".join(stream(IncrementalDetokenizer(tok, prompt_token_ids=prompt), answer, [1] * len(answer)))
        assert streamed == _continuation(reference, prompt, answer), cut
        other = tok.encode(" Hello", add_special_tokens=False)  # an answer that leaves the character unfinished
        streamed = "".join(stream(IncrementalDetokenizer(tok, prompt_token_ids=prompt), other, [1] * len(other)))
        assert streamed == _continuation(reference, prompt, other), cut
    assert unfinished >= 2, "some cuts fall inside a character"


def test_a_prompt_whose_last_tokens_write_no_text_keeps_the_answers_leading_space(metaspace_dir):
    """A completion prompt " " (a lone "▁", whose space the decoder strips) was no context: the
    answer was decoded alone and lost the space before its first word."""
    from transformers import PreTrainedTokenizerFast

    tok, reference = Tokenizer.from_model_dir(metaspace_dir), PreTrainedTokenizerFast.from_pretrained(metaspace_dir)
    prompt, answer = tok.encode(" ", add_special_tokens=True), tok.encode(" The fox", add_special_tokens=False)
    assert tok.decode(prompt) == ""
    streamed = "".join(stream(IncrementalDetokenizer(tok, prompt_token_ids=prompt), answer, [1] * len(answer)))
    assert streamed == _continuation(reference, prompt, answer) == " The fox"
