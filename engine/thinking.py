"""A reasoning model's thinking in a request's output: where it is, what it means for the
request's grammar, and its token budget.

The router reads from the rendered prompt where the answer starts (router/openai_api/reasoning.py)
and sends a ``Thinking``: the output thinks from its first token (``inside``: the prompt opened
``<think>``, or DeepSeek-R1's rule; an ``opener`` the model writes first anyway is no thinking
token), or only if its first token is ``opener`` (the model may open it itself), up to and with
``closer`` (``</think>``). A sequence keeps a ``ThinkingState`` that every
appended token advances; the tokens after the thinking are the answer.

- A structured output (engine.grammar) constrains the answer only: the thinking is free, the
  grammar's matcher starts at the answer's first token, and a first row where the opener may come
  allows it beside the grammar's tokens.
- ``budget`` (vLLM's ``thinking_token_budget``): at most that many tokens inside the thinking,
  the opener not counted; then the next token is the closer, whatever the model would draw.
"""

from __future__ import annotations

from dataclasses import dataclass

BEFORE, INSIDE, ANSWER = "before", "inside", "answer"


@dataclass(slots=True, frozen=True)
class Thinking:
    """Where the thinking of a request's output is (see the module docstring)."""

    closer: int
    opener: int | None = None
    budget: int | None = None
    inside: bool = False  # thinking from the first token (else only if that one is the opener)

    def state(self, output: list[int] = ()) -> "ThinkingState":
        """The state after ``output`` (a resumed stream's tokens, the prefill actor's first)."""
        state = ThinkingState(self, INSIDE if self.inside or self.opener is None else BEFORE)
        for token_id in output:
            state.accept(token_id)
        return state


class ThinkingState:
    """One sequence's place in its thinking: ``phase`` (before its first token where the model
    may open it, inside it, or in the answer) and the tokens inside so far."""

    __slots__ = ("thinking", "phase", "count", "seen")

    def __init__(self, thinking: Thinking, phase: str, count: int = 0, seen: int = 0) -> None:
        self.thinking = thinking
        self.phase = phase
        self.count = count
        self.seen = seen  # output tokens accepted

    def accept(self, token_id: int) -> bool:
        """Advance by one output token; whether it is the answer's (not the thinking's)."""
        first, self.seen = self.seen == 0, self.seen + 1
        if self.phase == BEFORE:
            if token_id == self.thinking.opener:
                self.phase = INSIDE
                return False
            self.phase = ANSWER
            return True
        if self.phase == INSIDE:
            if token_id == self.thinking.closer:
                self.phase = ANSWER
            elif not (first and token_id == self.thinking.opener):
                self.count += 1
            return False
        return True

    @property
    def answering(self) -> bool:
        return self.phase == ANSWER

    @property
    def may_open(self) -> bool:
        """The next token is the output's first, which may open the thinking."""
        return self.phase == BEFORE

    def after(self, drafts: list[int]) -> "ThinkingState":
        """The state after ``drafts`` (speculative tokens before a row), this one unchanged."""
        state = ThinkingState(self.thinking, self.phase, self.count, self.seen)
        for token_id in drafts:
            state.accept(token_id)
        return state

    def answer_tokens(self, drafts: list[int]) -> list[int] | None:
        """Of ``drafts``, those that are the answer's (what a grammar reads before the row after
        them), or None where the row after them is still inside the thinking."""
        state = self.after([])
        for index, token_id in enumerate(drafts):
            if state.accept(token_id):
                return drafts[index:]
        return [] if state.answering or state.may_open else None

    def must_close(self) -> bool:
        """The budget is spent: the next token is the closer."""
        budget = self.thinking.budget
        return self.phase == INSIDE and budget is not None and self.count >= budget

    def may_close_after(self, unread: int) -> bool:
        """Whether the budget may force the closer after ``unread`` tokens the host has not
        read yet (an overlapped step's): only reading them decides (was one the closer?)."""
        budget = self.thinking.budget
        if budget is None or unread == 0:
            return self.must_close()
        if self.phase == INSIDE:
            return self.count + unread >= budget
        return self.phase == BEFORE and budget <= unread - 1  # the first unread one may open it
