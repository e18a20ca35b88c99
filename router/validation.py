"""Turn API requests into typed, validated internal requests, naming the field of any problem.

Cheap checks run first so malformed requests cost no tokenization; the context-length checks
run last, on the tokenized prompt. Every problem raises ``InvalidArgumentError`` whose field is
the path in the request message (``sampling.top_p``), which the servicer maps to
INVALID_ARGUMENT. Prompt + max_tokens beyond the context is refused rather than clamped (as
vLLM does) when max_tokens was given; an unset max_tokens defaults to what fits.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from engine.sampling_params import MAX_SEED, SamplingDefaults, SamplingParams
from engine.structured_output import StructuredOutput, check_grammar
from engine.thinking import Thinking
from router.api.pdserve.v1 import generation_pb2 as pb
from router.errors import ContextLengthError, DeadlineExceededError, InvalidArgumentError, NotFoundError
from router.proto_checks import check_known_fields

_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]+")
_WORKER_ID_RE = _REQUEST_ID_RE


@dataclass(slots=True, frozen=True)
class RequestLimits:
    """What one request may ask of this deployment; built from the model's info at startup."""

    vocab_size: int
    max_context_len: int
    default_max_tokens: int = 16
    max_logprobs: int = SamplingParams.MAX_LOGPROBS
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 64
    # Every decode step checks each bad word's tokens against each row's output: a list of
    # thousands would slow every step, and a million would tie up the tokenizer for seconds.
    max_bad_words: int = 1024
    max_bad_word_chars: int = 256
    max_request_id_chars: int = 128
    # Characters of prompt_text per token of context (a token of code can hold a long run of
    # spaces): text far longer than any prompt that fits is refused before it is tokenized.
    max_prompt_chars_per_token: int = 64
    min_priority: int = -100
    max_priority: int = 100
    lora_names: frozenset[str] = frozenset()  # the LoRA adapters a request may name
    # The model's generation_config.json values for fields a request leaves unset.
    defaults: SamplingDefaults = SamplingDefaults()


@dataclass(slots=True)
class ValidatedRequest:
    """A Generate request the router can act on: tokenized, with engine sampling parameters."""

    req_id: str
    prompt_token_ids: list[int]
    prompt_text: str | None  # None when the client sent token ids
    sampling_params: SamplingParams
    stop: list[str]
    skip_special_tokens: bool
    priority: int  # higher is served first
    arrival_time: float  # time.monotonic()
    deadline: float | None  # time.monotonic() by which the request must finish; None: no deadline
    # vLLM's include_stop_str_in_output: the stop string (or stop token's text) that ended the
    # answer stays in it.
    include_stop_str: bool = False


@dataclass(slots=True)
class GenerateInput:
    """A generation request as an API edge hands it over, before validation: None is unset.

    The field names in errors are the API's own: ``sampling_prefix`` goes before each sampling
    field's name (``sampling.`` for gRPC, nothing for the OpenAI API) unless ``field_names``
    renames it, and the prompt is named ``text_field`` or ``ids_field``.
    """

    request_id: str = ""
    prompt_text: str | None = None
    prompt_token_ids: list[int] | None = None
    # A chat prompt already holds its special tokens, rendered by its template.
    add_special_tokens: bool = True
    max_tokens: int | None = None
    # Unset max_tokens: the context's room (chat completions, the Responses API, as vLLM
    # and OpenAI answer a conversation) rather than RequestLimits.default_max_tokens (completions'
    # and gRPC's 16); the model's generation_config max_new_tokens, where it sets one, is a
    # conversation's default instead, and caps the 16 (as vLLM's completions take it: the
    # smaller); the context's room still bounds either.
    max_tokens_fills_context: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    priority: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    structured: StructuredOutput | None = None
    include_stop_str: bool = False
    cache_salt: str | None = None  # vLLM's: the prefix cache is shared only with requests of the same salt
    # vLLM's truncate_prompt_tokens: only the prompt's last this many tokens are read (-1: as
    # many as the context takes); None: the whole prompt.
    truncate_prompt_tokens: int | None = None
    thinking: Thinking | None = None  # a reasoning model's thinking and its budget (engine.thinking)
    lora_name: str | None = None  # the LoRA adapter it runs through; None: the base model
    sampling_prefix: str = "sampling."
    text_field: str = "prompt_text"
    ids_field: str = "prompt_token_ids"
    # A sampling field the API names otherwise (Anthropic's stop_sequences, the Responses API's
    # max_output_tokens): errors name it as the client sent it.
    field_names: dict[str, str] = field(default_factory=dict)

    def field_name(self, name: str) -> str:
        """A sampling field's name as this API spells it, in errors."""
        return self.field_names.get(name, self.sampling_prefix + name)


def validate_generate_request(
    request: pb.GenerateRequest,
    limits: RequestLimits,
    encode: Callable[..., list[int]],
    *,
    timeout_s: float | None = None,
    now: float | None = None,
) -> ValidatedRequest:
    """Validate and tokenize a gRPC ``request``; ``timeout_s`` is the RPC's remaining deadline, if any."""
    return validate_input(input_from_proto(request), limits, encode, timeout_s=timeout_s, now=now)


def input_from_proto(request: pb.GenerateRequest) -> GenerateInput:
    """A gRPC GenerateRequest as the neutral input (unknown fields and two prompts refused here;
    a chat's conversation is read by router.grpc_chat)."""
    check_known_fields(request)
    sampling = request.sampling

    def given(name: str):
        return getattr(sampling, name) if sampling.HasField(name) else None

    has_text, has_ids = request.HasField("prompt_text"), len(request.prompt_token_ids) > 0
    if has_text + has_ids + request.HasField("chat") > 1:
        raise InvalidArgumentError("prompt", "set only one of prompt_text, prompt_token_ids and chat")
    return GenerateInput(
        request_id=request.request_id,
        prompt_text=request.prompt_text if has_text else None,
        prompt_token_ids=list(request.prompt_token_ids) if has_ids else None,
        max_tokens=given("max_tokens"),
        temperature=given("temperature"),
        # top_k is not optional in the proto: 0 leaves it to the model's default (-1 disables it).
        top_k=sampling.top_k or None,
        top_p=given("top_p"),
        min_p=given("min_p"),  # set to 0, it disables a model's min_p (unset: the model's)
        seed=_signed_seed(given("seed")),
        repetition_penalty=given("repetition_penalty"),
        stop=list(sampling.stop),
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        logprobs=given("logprobs"),
        prompt_logprobs=given("prompt_logprobs"),
        min_tokens=sampling.min_tokens,
        skip_special_tokens=sampling.skip_special_tokens if sampling.HasField("skip_special_tokens") else True,
        include_stop_str=sampling.include_stop_str_in_output,
        cache_salt=sampling.cache_salt if sampling.HasField("cache_salt") else None,
        truncate_prompt_tokens=request.truncate_prompt_tokens if request.HasField("truncate_prompt_tokens") else None,
        priority=request.priority,
        lora_name=request.lora_name if request.HasField("lora_name") else None,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        logit_bias={int(token): float(bias) for token, bias in sampling.logit_bias.items()},
        allowed_token_ids=list(sampling.allowed_token_ids) or None,
        bad_words=list(sampling.bad_words),
        structured=_structured_from_proto(sampling),
    )


def _structured_from_proto(sampling: pb.SamplingParams) -> StructuredOutput | None:
    if not sampling.HasField("structured_output"):
        return None
    message = sampling.structured_output
    kind = message.WhichOneof("kind")
    if kind is None:
        raise InvalidArgumentError("sampling.structured_output", "set one of json_schema, json_object, regex, choice, grammar")
    value = list(message.choice.values) if kind == "choice" else getattr(message, kind)
    try:
        return StructuredOutput.build(kind, value, f"sampling.structured_output.{kind}")
    except InvalidRequestError as exc:
        raise InvalidArgumentError(exc.field, exc.problem) from None


def validate_input(
    request: GenerateInput,
    limits: RequestLimits,
    encode: Callable[..., list[int]],
    *,
    timeout_s: float | None = None,
    now: float | None = None,
) -> ValidatedRequest:
    """Validate and tokenize ``request``; ``timeout_s`` is the caller's remaining deadline, if any."""
    now = time.monotonic() if now is None else now
    deadline = _deadline(timeout_s, now)
    req_id = _request_id(request.request_id, limits)
    if not limits.min_priority <= request.priority <= limits.max_priority:
        raise InvalidArgumentError(
            "priority", f"must be in [{limits.min_priority}, {limits.max_priority}], got {request.priority}"
        )
    if request.lora_name is not None and request.lora_name not in limits.lora_names:
        served = ", ".join(sorted(limits.lora_names)) or "none"
        raise NotFoundError(f"lora_name: no LoRA adapter named {request.lora_name!r} is served here (served: {served})")
    stop = _stop_strings(request.stop, limits, request.field_name("stop"))
    params = _sampling_params(request, limits, encode)
    prompt_text, prompt_token_ids = _prompt(request, limits, encode)
    _fit_context(params, len(prompt_token_ids), limits, request)
    return ValidatedRequest(
        req_id=req_id,
        prompt_token_ids=prompt_token_ids,
        prompt_text=prompt_text,
        sampling_params=params,
        stop=stop,
        skip_special_tokens=request.skip_special_tokens,
        priority=request.priority,
        arrival_time=now,
        deadline=deadline,
        include_stop_str=request.include_stop_str,
    )


def validate_scale_pool_request(request: pb.ScalePoolRequest, max_replicas: int) -> None:
    """Refuse an unset or unknown role and a replica count beyond ``max_replicas``."""
    check_known_fields(request)
    if request.role == pb.WORKER_ROLE_UNSPECIFIED:
        raise InvalidArgumentError("role", "must be WORKER_ROLE_PREFILL or WORKER_ROLE_DECODE")
    if request.replicas > max_replicas:
        raise InvalidArgumentError("replicas", f"must be at most {max_replicas}, got {request.replicas}")


def validate_drain_worker_request(request: pb.DrainWorkerRequest) -> None:
    """Refuse an empty or malformed worker id (an unknown one is NOT_FOUND, decided by the caller)."""
    check_known_fields(request)
    if not request.worker_id:
        raise InvalidArgumentError("worker_id", "must not be empty")
    if len(request.worker_id) > 128 or not _WORKER_ID_RE.fullmatch(request.worker_id):
        raise InvalidArgumentError("worker_id", "must be at most 128 characters from [A-Za-z0-9._:-]")


def _deadline(timeout_s: float | None, now: float) -> float | None:
    if timeout_s is None:
        return None
    if timeout_s <= 0:
        raise DeadlineExceededError("the request's deadline passed before it was admitted")
    return now + timeout_s


def _request_id(request_id: str, limits: RequestLimits) -> str:
    if not request_id:
        return uuid.uuid4().hex
    if len(request_id) > limits.max_request_id_chars:
        raise InvalidArgumentError(
            "request_id", f"must be at most {limits.max_request_id_chars} characters, got {len(request_id)}"
        )
    if not _REQUEST_ID_RE.fullmatch(request_id):
        # Ids end up in log lines and metric labels: keep them printable and unambiguous.
        raise InvalidArgumentError("request_id", "may only contain letters, digits and . _ : -")
    return request_id


def _stop_strings(stop: list[str], limits: RequestLimits, name: str) -> list[str]:
    if len(stop) > limits.max_stop_strings:
        raise InvalidArgumentError(name, f"at most {limits.max_stop_strings} stop strings, got {len(stop)}")
    for index, text in enumerate(stop):
        if not text:
            raise InvalidArgumentError(f"{name}[{index}]", "must not be empty")
        if len(text) > limits.max_stop_string_chars:
            raise InvalidArgumentError(
                f"{name}[{index}]", f"must be at most {limits.max_stop_string_chars} characters, got {len(text)}"
            )
    return list(dict.fromkeys(stop))


def _sampling_params(request: GenerateInput, limits: RequestLimits, encode: Callable[..., list[int]]) -> SamplingParams:
    prefix = request.sampling_prefix
    if request.max_tokens is not None and request.max_tokens < 1:
        raise InvalidArgumentError(request.field_name("max_tokens"), "must be >= 1 (leave it unset for the default)")
    if len(request.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidArgumentError(
            f"{prefix}stop_token_ids", f"at most {limits.max_stop_token_ids} ids, got {len(request.stop_token_ids)}"
        )
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(request, name)
        if value is not None and value > limits.max_logprobs:
            raise InvalidArgumentError(f"{prefix}{name}", f"must be in [0, {limits.max_logprobs}], got {value}")
    defaults = limits.defaults

    def pick(given, model_default, default):
        return given if given is not None else model_default if model_default is not None else default

    if request.max_tokens_fills_context:  # a conversation: the model's max_new_tokens, else the context's room
        unset_max_tokens = pick(None, defaults.max_tokens, limits.max_context_len)
    else:  # completions (and gRPC): 16, or the model's max_new_tokens where smaller, as vLLM's completions
        unset_max_tokens = min(limits.default_max_tokens, pick(None, defaults.max_tokens, limits.default_max_tokens))
    params = SamplingParams(
        # Unset, it defaults to what fits (_fit_context), and never below min_tokens.
        max_tokens=pick(request.max_tokens, None, max(unset_max_tokens, request.min_tokens)),
        temperature=pick(request.temperature, defaults.temperature, 1.0),
        top_k=pick(request.top_k, defaults.top_k, 0),
        top_p=pick(request.top_p, defaults.top_p, 1.0),
        min_p=pick(request.min_p, defaults.min_p, 0.0),
        seed=request.seed,
        repetition_penalty=pick(request.repetition_penalty, defaults.repetition_penalty, 1.0),
        stop_token_ids=list(dict.fromkeys(request.stop_token_ids)),
        ignore_eos=request.ignore_eos,
        logprobs=request.logprobs,
        prompt_logprobs=request.prompt_logprobs,
        min_tokens=request.min_tokens,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        logit_bias=dict(request.logit_bias),
        allowed_token_ids=None if request.allowed_token_ids is None else list(dict.fromkeys(request.allowed_token_ids)),
        bad_words_token_ids=_bad_words_token_ids(request.bad_words, limits, encode, prefix),
        structured=request.structured,
        thinking=request.thinking,
        lora_name=request.lora_name,
        cache_salt=request.cache_salt,
    )
    try:
        params.validate(limits.vocab_size)
    except InvalidRequestError as exc:
        raise InvalidArgumentError(request.field_name(exc.field), exc.problem) from exc
    if params.structured is not None:
        try:
            check_grammar(params.structured)
        except InvalidRequestError as exc:  # its field is already the API's full name
            raise InvalidArgumentError(exc.field, exc.problem) from exc
    return params


def _bad_words_token_ids(words: list[str], limits: RequestLimits, encode: Callable[..., list[int]], prefix: str) -> list[list[int]]:
    """vLLM's reading of bad words: each word's tokens as it stands, and with a leading space
    (the word in mid-text) where that tokenizes to as many tokens with a different first."""
    if len(words) > limits.max_bad_words:
        raise InvalidArgumentError(f"{prefix}bad_words", f"at most {limits.max_bad_words} words, got {len(words)}")
    for index, word in enumerate(words):
        if len(word) > limits.max_bad_word_chars:
            raise InvalidArgumentError(f"{prefix}bad_words[{index}]", f"must be at most {limits.max_bad_word_chars} characters, got {len(word)}")
    sequences: list[list[int]] = []
    for word in words:
        alone = encode(word.lstrip(), add_special_tokens=False)
        if alone:
            sequences.append(alone)
        spaced = encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and alone and spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    return sequences


def _prompt(request: GenerateInput, limits: RequestLimits, encode: Callable[..., list[int]]) -> tuple[str | None, list[int]]:
    text_field, ids_field = request.text_field, request.ids_field
    if request.prompt_text is not None and request.prompt_token_ids is not None:
        raise InvalidArgumentError("prompt", f"set only one of {text_field} and {ids_field}")
    if request.prompt_text is None and not request.prompt_token_ids:
        if text_field == ids_field:
            raise InvalidArgumentError(text_field, "must not be empty")
        raise InvalidArgumentError("prompt", f"set {text_field} or {ids_field} (the prompt is empty)")
    keep = _tokens_kept(request, limits)
    if request.prompt_token_ids is not None:
        token_ids = _truncated(list(request.prompt_token_ids), keep)
        # Length first: refusing an over-long prompt should not cost a scan of every id.
        _check_prompt_fits(len(token_ids), limits, ids_field)
        _check_vocabulary(token_ids, limits, ids_field, by_position=True, offset=len(request.prompt_token_ids) - len(token_ids))
        return None, token_ids
    # An empty text is the start of a document where the tokenizer writes one (its BOS), as
    # OpenAI's and vLLM's completions take it; refused below where it is no tokens at all.
    text = request.prompt_text
    if keep is None:  # a prompt to be cut may be longer (the body's size bounds it)
        check_prompt_chars(text, limits, text_field, "; or set truncate_prompt_tokens")
    token_ids = encode(text) if request.add_special_tokens else encode(text, add_special_tokens=False)
    whole = len(token_ids)
    if keep is not None and len(token_ids) > keep:
        token_ids = _cut_text_prompt(token_ids, encode(text, add_special_tokens=False) if request.add_special_tokens else token_ids, keep)
    if not token_ids:
        raise InvalidArgumentError(text_field, "must not be empty" if not text else "tokenizes to no tokens")
    # A tokenizer with more entries than the model's embedding (added tokens past it) yields
    # ids the model cannot take: checked like ids sent directly, named by the text's field.
    _check_vocabulary(token_ids, limits, text_field, by_position=False)
    return (text if len(token_ids) == whole else None), token_ids  # a cut prompt is its tokens only


def _tokens_kept(request: GenerateInput, limits: RequestLimits) -> int | None:
    """How many of the prompt's last tokens are read (truncate_prompt_tokens; -1: as many as
    leave the context room for the answer's max_tokens, or one token); None: all."""
    keep = request.truncate_prompt_tokens
    if keep is None or keep >= 1:
        return keep
    if keep == -1:
        return max(1, limits.max_context_len - max(1, request.max_tokens or 1))
    raise InvalidArgumentError("truncate_prompt_tokens", f"must be >= 1 (or -1: as many as the context takes), got {keep}")


def _truncated(token_ids: list[int], keep: int | None) -> list[int]:
    return token_ids if keep is None else token_ids[-keep:]


def _cut_text_prompt(token_ids: list[int], text_ids: list[int], keep: int) -> list[int]:
    """A text prompt's last ``keep`` tokens as a tokenizer truncating from the left gives them:
    the special tokens it adds around the text (a BOS) kept, the text's own tokens cut."""
    for start in range(len(token_ids) - len(text_ids) + 1):
        if token_ids[start : start + len(text_ids)] == text_ids:
            before, after = token_ids[:start], token_ids[start + len(text_ids) :]
            room = keep - len(before) - len(after)
            if room > 0:
                return before + text_ids[-room:] + after
            break
    return token_ids[-keep:]


def check_prompt_chars(text: str, limits: RequestLimits, field: str, hint: str = "") -> None:
    """InvalidArgumentError naming ``field`` where ``text`` is longer than a prompt may be (a
    tokenizing of megabytes would hold the router's tokenizing thread)."""
    max_chars = limits.max_prompt_chars_per_token * limits.max_context_len
    if len(text) > max_chars:
        raise InvalidArgumentError(
            field,
            f"has {len(text)} characters; at most {max_chars} are taken "
            f"({limits.max_prompt_chars_per_token} per token of the model's {limits.max_context_len}-token context{hint})",
        )


def _check_vocabulary(token_ids: list[int], limits: RequestLimits, field: str, by_position: bool, offset: int = 0) -> None:
    """``offset``: where ``token_ids`` start in what the client sent (a cut prompt's ids)."""
    for index, token_id in enumerate(token_ids):
        if not 0 <= token_id < limits.vocab_size:
            outside = f"outside the model's vocabulary (size {limits.vocab_size})"
            if by_position:
                raise InvalidArgumentError(f"{field}[{offset + index}]", f"token id {token_id} is {outside}")
            raise InvalidArgumentError(field, f"tokenizes to token id {token_id} (at {index}), {outside}")


def _check_prompt_fits(num_prompt_tokens: int, limits: RequestLimits, field: str) -> None:
    if num_prompt_tokens >= limits.max_context_len:
        raise ContextLengthError(
            field,
            f"This model's maximum context length is {limits.max_context_len} tokens. However, your request has "
            f"{num_prompt_tokens} input tokens; at most {limits.max_context_len - 1} fit, so that one token can be generated",
        )


def _fit_context(params: SamplingParams, num_prompt_tokens: int, limits: RequestLimits, request: GenerateInput) -> None:
    _check_prompt_fits(num_prompt_tokens, limits, request.text_field if request.prompt_text is not None else request.ids_field)
    room = limits.max_context_len - num_prompt_tokens
    if request.max_tokens is None:  # unset: what fits, never below min_tokens
        params.max_tokens = min(max(params.max_tokens, params.min_tokens), room)
        if params.min_tokens > params.max_tokens:
            raise _past_context(request.field_name("min_tokens"), params.min_tokens, num_prompt_tokens, room, limits)
    elif params.max_tokens > room:
        raise _past_context(request.field_name("max_tokens"), params.max_tokens, num_prompt_tokens, room, limits)


def _past_context(name: str, count: int, num_prompt_tokens: int, room: int, limits: RequestLimits) -> ContextLengthError:
    context = limits.max_context_len
    return ContextLengthError(
        name,
        f"'{name.rpartition('.')[2]}' is too large: {count}. This model's maximum context length is {context} tokens "
        f"and your request has {num_prompt_tokens} input tokens ({count} > {context} - {num_prompt_tokens}); "
        f"at most {room} new tokens fit",
    )


def _signed_seed(seed: int | None) -> int | None:
    """A proto seed (uint64) as the engine's (int64): the upper half is the negative seeds (two's
    complement), so every 64-bit value is a seed, as vLLM takes any; it was refused above 2^63."""
    return seed - 2**64 if seed is not None and seed > MAX_SEED else seed
