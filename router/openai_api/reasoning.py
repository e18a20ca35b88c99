"""A reasoning model's answer split in two: its thinking (``<think>`` ... ``</think>``) and the
answer the client reads, as vLLM's reasoning parsers (``--reasoning-parser``) split them.

Where thinking starts is the prompt's and the model's: a chat template that opens ``<think>``
at the end of the prompt (DeepSeek-R1's, Qwen3.5's, Qwen3 thinking-2507's) leaves the answer
inside it until the model writes ``</think>``; one that closes it there (Qwen3's
``enable_thinking: false``) leaves none; otherwise the model may open it as the first thing it
writes (Qwen3's older templates). ``deepseek_r1`` (and ``minimax_m2``) also reads an answer whose
prompt says nothing as thinking from the start (those models may leave out ``<think>``); ``qwen3``
(and ``glm45``, ``deepseek_v3``) reads it as the answer unless the model opens ``<think>``. Thinking cut off by ``max_tokens`` stays thinking.

The split is on the text, as it streams: what may be the start of a marker is held back until
the next piece says. The engine is told where the thinking is (``thinking``, engine.thinking):
a structured-output grammar constrains the answer after it (the model thinks freely, then
answers under the grammar; where the model may open its thinking itself, it does so only if its
first token is ``<think>``), and a thinking budget (vLLM's ``thinking_token_budget``, Anthropic's
``budget_tokens``) forces ``</think>`` once spent. Tool calls are read from the answer only.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.thinking import Thinking
from router.errors import InvalidArgumentError
from router.openai_api.parser_names import REASONING_PARSERS, THINKS_FROM_THE_START
from router.openai_api.tool_blocks import marker_prefix_len
from router.tokenizer import Tokenizer

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def as_written(message: dict) -> str:
    """An assistant message as its model wrote it: its thinking (the reasoning fields it came
    back in) inside the markers, then its text. What says whether an answer that continues the
    message goes on inside the thinking."""
    thought = message.get("reasoning_content")
    return (f"{THINK_OPEN}{thought}{THINK_CLOSE}" if thought else "") + (message.get("content") or "")


@dataclass(slots=True, frozen=True)
class ReasoningFormat:
    """A deployment's reasoning parser: its name and the token ids of its markers."""

    parser: str
    open_token_id: int
    close_token_id: int

    def starts_inside(self, prompt_text: str, continues: str | None = None) -> bool | None:
        """Whether the answer to ``prompt_text`` starts inside the thinking: True (the prompt
        opened it), False (the prompt closed it, right at its end: thinking turned off), None
        (the model may open it as it starts). ``continues``: the assistant message the answer
        goes on with (continue_final_message), whose own thinking may be open or closed."""
        if continues:
            opened, closed = continues.rfind(THINK_OPEN), continues.rfind(THINK_CLOSE)
            if opened != closed:  # one of them is there: the later one says
                return opened > closed
            if continues.strip():
                # Text with no marker at all: an answer the message began (a prefill), which
                # goes on as answer, whatever a parser that thinks from the start assumes.
                return False
        # Only a marker at the prompt's very end is the template's: one in a message's text
        # ("what does <think> mean?") says nothing about the answer.
        tail = prompt_text.rstrip()
        if tail.endswith(THINK_OPEN):
            return True
        if tail.endswith(THINK_CLOSE):
            return False
        return True if THINKS_FROM_THE_START[self.parser] else None

    def thinking(self, prompt_text: str, budget: int | None = None, continues: str | None = None) -> Thinking | None:
        """Where the engine finds the thinking in this prompt's answer (engine.thinking): from
        the first token where the prompt opened it; where the model may open it itself, only if
        its first token is ``<think>`` (an answer that does not think is all answer, its grammar
        holding from the first token); none where thinking is off. ``budget``: its token budget."""
        inside = self.starts_inside(prompt_text, continues)
        if inside is False:
            return None
        return Thinking(self.close_token_id, self.open_token_id, budget, inside=bool(inside))


def read_effort(value, field: str) -> str | None:
    """OpenAI's ``reasoning_effort`` (chat) or ``reasoning.effort`` (Responses), checked. It goes
    to the chat template as its ``reasoning_effort`` variable, as vLLM passes it: a template that
    reads it (gpt-oss's, Hunyuan's) steers its thinking with it; others ignore it."""
    if value is None:
        return None
    if value not in REASONING_EFFORTS:
        raise InvalidArgumentError(field, f"must be one of {', '.join(REASONING_EFFORTS)}, got {value!r}")
    return value


def reasoning_format(parser: str | None, tokenizer: Tokenizer) -> ReasoningFormat | None:
    """The configured parser (router.reasoning_parser) over the model's tokenizer; ValueError
    naming the field unless both markers are tokens of their own that decode to their text
    (the split reads the text)."""
    if parser is None:
        return None
    if parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser: one of {', '.join(REASONING_PARSERS)} (or unset), got {parser!r}")
    ids = {}
    for marker in (THINK_OPEN, THINK_CLOSE):
        token_id = tokenizer.token_to_id(marker)
        if token_id is None or tokenizer.decode([token_id]) != marker:
            raise ValueError(f"reasoning_parser: {parser} needs {marker} as a token of the model's vocabulary that decodes to its text")
        ids[marker] = token_id
    return ReasoningFormat(parser, ids[THINK_OPEN], ids[THINK_CLOSE])


class ReasoningSplitter:
    """One choice's answer, piece by piece, into (thinking, answer) text, for the thinking the
    engine was told of (``ReasoningFormat.thinking``; None: thinking is off, all is answer)."""

    def __init__(self, thinking: Thinking | None):
        # Inside the thinking until </think>, or in the answer; before any text a <think> the
        # model writes (whitespace before it goes with it) opens the thinking, or repeats the
        # prompt's and is dropped.
        self._inside = thinking is not None and thinking.inside
        self._may_open = thinking is not None
        self._tokens = thinking.state() if thinking is not None else None  # the same, by token id (usage)
        self._held = ""  # text that may be the start of the marker looked for

    def feed(self, text: str) -> tuple[str, str]:
        text, self._held = self._held + text, ""
        thinking = answer = ""
        while text:
            if self._may_open:
                stripped = text.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._inside, text = True, stripped[len(THINK_OPEN) :]
                elif THINK_OPEN.startswith(stripped):
                    self._held = text  # whitespace, or the start of "<think>": not known yet
                    break
                self._may_open = False
                continue
            if not self._inside:
                answer += text
                break
            end = text.find(THINK_CLOSE)
            if end >= 0:
                thinking += text[:end]
                self._inside, text = False, text[end + len(THINK_CLOSE) :]
                continue
            keep = marker_prefix_len(text, THINK_CLOSE)
            thinking += text[: len(text) - keep]
            self._held = text[len(text) - keep :]
            break
        return thinking, answer

    def thinking_tokens(self, token_ids: list[int]) -> int:
        """How many of these next output tokens are the thinking's (its markers too), by id: the
        text may show ``</think>`` chunks after its token (a detokenizer holding text back)."""
        if self._tokens is None:
            return 0
        return sum(not self._tokens.accept(token_id) for token_id in token_ids)

    def take(self, text: str, last: bool) -> tuple[str, str]:
        """``feed``, and ``finish`` too where ``text`` is the answer's last piece."""
        thinking, answer = self.feed(text)
        if last:
            more_thinking, more_answer = self.finish()
            thinking, answer = thinking + more_thinking, answer + more_answer
        return thinking, answer

    def finish(self) -> tuple[str, str]:
        """What was held back, once the answer has ended."""
        held, self._held = self._held, ""
        return (held, "") if self._inside else ("", held)
