"""A prefill actor given a newer attempt of a request it still holds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from prefill_workers.worker import PrefillWorker


@pytest.mark.parametrize("call", ["submit", "open_stage"])
def test_a_newer_attempt_replaces_one_whose_cancel_never_arrived(call):
    """The router gave an attempt up and its cancel did not reach this actor (briefly
    unreachable); the retry landed here and was refused as "already running", which the client
    got as a bad request of its own. The older attempt is cancelled and the newer one runs, a
    pipeline stage's too (its open was still refused)."""
    cancelled, added = [], []
    jobs = {"r": SimpleNamespace(request=SimpleNamespace(destination=SimpleNamespace(token=1)))}

    def cancel(req_id, token):
        cancelled.append((req_id, token))
        jobs.pop(req_id)

    def add_request(req_id, *args):
        assert req_id not in jobs, "already running"
        added.append(req_id)
        return SimpleNamespace(num_computed_tokens=0, num_prompt_tokens=2)

    worker = SimpleNamespace(
        _check_accepting=lambda request: None, _jobs=jobs, _cancel=cancel, activations=None,
        engine=SimpleNamespace(add_request=add_request, make_sequence=add_request), scheduler=SimpleNamespace(add_stage=lambda seq, salt: None),
        _add_job=lambda request, seq: SimpleNamespace(done="future"),
    )
    worker._replace_earlier_attempt = lambda request: PrefillWorker._replace_earlier_attempt(worker, request)
    request = SimpleNamespace(req_id="r", prompt_token_ids=[1, 2], params=None, priority=0, destination=SimpleNamespace(token=2),
                              stage=SimpleNamespace(salt=None, is_first=True))
    if call == "submit":
        assert PrefillWorker._enqueue(worker, request) == "future"
    else:
        assert PrefillWorker._open_stage(worker, request).num_cached_tokens == 0
    assert cancelled == [("r", 1)] and added == ["r"]
