"""Elastic intra-op threads (engine.elastic_threads): an engine takes the whole cores the host's
other processes leave idle, gives them back when a neighbour is busy again, and never goes beyond
its bounds; the real /proc readings are sane; an engine built with it still computes exactly."""

from __future__ import annotations

import pytest

from engine.elastic_threads import ElasticThreads, host_busy_seconds, own_busy_seconds


class _Host:
    """A fake host: each ``advance`` runs the neighbours and this process for ``seconds``."""

    def __init__(self):
        self.now = self.host = self.own = 0.0

    def advance(self, seconds: float, neighbours_cores: float, own_cores: float) -> None:
        self.now += seconds
        self.own += own_cores * seconds
        self.host += (neighbours_cores + own_cores) * seconds


def _elastic(host: _Host, base=1, most=2, cores=2):
    changes = []
    elastic = ElasticThreads(base, most, changes.append, num_cores=cores, host_busy=lambda: host.host, own_busy=lambda: host.own, clock=lambda: host.now)
    return elastic, changes


def test_it_grows_into_an_idle_neighbours_core_and_gives_it_back():
    host = _Host()
    elastic, changes = _elastic(host)
    host.advance(0.6, neighbours_cores=1.0, own_cores=1.0)  # the prefill neighbour computes
    assert elastic.before_step() == 1 and changes == []
    host.advance(0.6, neighbours_cores=0.05, own_cores=1.0)  # its queue ran dry: a core idles
    assert elastic.before_step() == 2 and changes == [2]
    host.advance(0.6, neighbours_cores=0.0, own_cores=2.0)  # its own second thread is not a neighbour
    assert elastic.before_step() == 2
    host.advance(0.6, neighbours_cores=0.9, own_cores=1.5)  # the neighbour is back
    assert elastic.before_step() == 1 and changes == [2, 1]


def test_it_waits_a_window_and_keeps_within_its_bounds():
    host = _Host()
    elastic, changes = _elastic(host, base=2, most=3, cores=8)
    host.advance(0.1, neighbours_cores=0.0, own_cores=2.0)
    assert elastic.before_step() == 2 and changes == []  # less than a window: no reading yet
    host.advance(0.5, neighbours_cores=0.0, own_cores=2.0)
    assert elastic.before_step() == 3  # six cores idle, but at most 3 threads
    host.advance(0.6, neighbours_cores=8.0, own_cores=2.0)
    assert elastic.before_step() == 2  # never below num_threads
    with pytest.raises(ValueError, match="max_num_threads"):
        ElasticThreads(2, 1, lambda n: None)


def test_the_proc_readings_grow_with_work():
    before_host, before_own = host_busy_seconds(), own_busy_seconds()
    total = 0
    for i in range(3_000_000):
        total += i
    assert own_busy_seconds() > before_own and host_busy_seconds() >= before_host + (own_busy_seconds() - before_own) * 0.5


def test_an_engine_with_elastic_threads_generates_what_one_without_does(e2e_model):
    from engine import LLMEngine, SamplingParams
    from engine.config import EngineConfig

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = [[5, 17, 99, 3, 42] * 9]
    fixed = LLMEngine(e2e_model.path, EngineConfig(num_threads=1)).generate(prompt, params)[0].token_ids
    elastic = LLMEngine(e2e_model.path, EngineConfig(num_threads=1, max_num_threads=2))
    assert elastic.elastic_threads is not None
    assert elastic.generate(prompt, params)[0].token_ids == fixed
    with pytest.raises(ValueError, match="max_num_threads"):
        EngineConfig(num_threads=2, max_num_threads=1).validate()
