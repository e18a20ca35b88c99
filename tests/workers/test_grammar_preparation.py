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


def test_every_way_a_request_enters_a_worker_prepares_its_grammar_before_the_engine_thread_takes_it():
    """A decode reservation, a local prompt, a prefill and a pipeline stage: each had its grammar
    built on the engine thread, between the steps of every running stream."""
    from concurrent.futures import Future

    from decode_workers.worker import DecodeWorker
    from prefill_workers.worker import PrefillWorker

    def worker(calls):
        async def prepare(params):
            calls.append("prepare")

        async def call(fn, *args):
            calls.append("engine thread")

        def thread_call(fn, *args):
            calls.append("engine thread")
            done, result = Future(), Future()
            result.set_result("first token")
            done.set_result(result)
            return done

        return SimpleNamespace(_prepare_grammar=prepare, _call=call, _heard_from=lambda *a: None, _answer_delay_s=0.0,
                               _thread=SimpleNamespace(call=thread_call), _enqueue=None, _reserve=None, _add_local=None, _open_stage=None)

    request = SimpleNamespace(params=SamplingParams(), router_id="router", router_lease_s=10.0)
    for entry in (DecodeWorker.reserve, DecodeWorker.add_local, PrefillWorker.submit, PrefillWorker.open_stage):
        calls: list[str] = []
        asyncio.run(entry(worker(calls), request))
        assert calls == ["prepare", "engine thread"], entry.__qualname__
