"""A constrained request's tokenizer and grammar are built before the engine thread takes it, on
a thread of their own: built there, the first one stalled every running stream (0.6 s for the
built-in model's 4k vocabulary here)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from engine import SamplingParams
from engine.default_model_path import DEFAULT_MODEL_PATH
from engine.errors import InvalidRequestError
from engine.grammar import Grammars
from engine.structured_output import StructuredOutput
from workers.base import EngineWorker


def _worker(grammars: Grammars):
    return SimpleNamespace(engine=SimpleNamespace(grammars=grammars))


def test_a_grammar_is_prepared_off_the_callers_thread_and_kept_for_the_engine_thread(monkeypatch):
    import json

    vocab = json.loads((DEFAULT_MODEL_PATH / "config.json").read_text())["vocab_size"]
    grammars = Grammars(DEFAULT_MODEL_PATH, vocab, [0])
    threads = []
    build = grammars._llg_tokenizer
    monkeypatch.setattr(grammars, "_llg_tokenizer", lambda: threads.append(threading.current_thread()) or build())
    params = SamplingParams(structured=StructuredOutput("regex", "(yes|no)", "structured_outputs.regex"))
    asyncio.run(EngineWorker._prepare_grammar(_worker(grammars), params))
    assert threads and all(t is not threading.main_thread() for t in threads), "built on a thread of its own"
    assert grammars._tokenizer is not None and ("regex", "(yes|no)") in grammars._compiled, "kept: the engine thread copies it"
    sequence = grammars.for_sequence(params.structured, [])
    assert len(grammars._compiled) == 1 and sequence is not None


def test_a_grammar_that_does_not_compile_is_refused_before_the_engine_thread_naming_its_field():
    import json

    vocab = json.loads((DEFAULT_MODEL_PATH / "config.json").read_text())["vocab_size"]
    grammars = Grammars(DEFAULT_MODEL_PATH, vocab, [0])
    params = SamplingParams(structured=StructuredOutput("regex", "(unclosed", "structured_outputs.regex"))
    with pytest.raises(InvalidRequestError) as refused:
        asyncio.run(EngineWorker._prepare_grammar(_worker(grammars), params))
    assert refused.value.field == "structured_outputs.regex"
