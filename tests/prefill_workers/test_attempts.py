"""A prefill actor given a newer attempt of a request it still holds."""

from __future__ import annotations

from types import SimpleNamespace

from prefill_workers.worker import PrefillWorker


def test_a_newer_attempt_replaces_one_whose_cancel_never_arrived():
    """The router gave an attempt up and its cancel did not reach this actor (briefly
    unreachable); the retry landed here and was refused as "already running", which the client
    got as a bad request of its own. The older attempt is cancelled and the newer one runs."""
    cancelled, added = [], []
    jobs = {"r": SimpleNamespace(request=SimpleNamespace(destination=SimpleNamespace(token=1)))}

    def cancel(req_id, token):
        cancelled.append((req_id, token))
        jobs.pop(req_id)

    def add_request(req_id, *args):
        assert req_id not in jobs, "already running"
        added.append(req_id)
        return "seq"

    worker = SimpleNamespace(
        _check_accepting=lambda request: None, _jobs=jobs, _cancel=cancel,
        engine=SimpleNamespace(add_request=add_request), _add_job=lambda request, seq: SimpleNamespace(done="future"),
    )
    request = SimpleNamespace(req_id="r", prompt_token_ids=[1, 2], params=None, priority=0, destination=SimpleNamespace(token=2))
    assert PrefillWorker._enqueue(worker, request) == "future"
    assert cancelled == [("r", 1)] and added == ["r"]
