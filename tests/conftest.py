"""Fixtures shared by every test package: one local Ray instance per test session, one small model."""

from __future__ import annotations

import fcntl
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

from cluster.local_ray import confine_to_loopback, release_loopback_confinement

# One torch thread per process keeps 2-core CI machines from oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_xdist_auto_num_workers(config):
    """Two test processes at most (one on a single core). Measured on a 2-core host, the whole
    suite: 973 s in one process, 810 s in two; the one process left 30% of the cores idle while
    its tests waited on process starts, leases and single-threaded steps. Each worker process
    is a test session with its own Ray instance, so more than two would only add Ray instances
    fighting over the same two cores: three took 595 s where two took 555 s, run back to back
    on a 2-core EPYC (both cores 96 to 99% busy)."""
    return max(1, min(2, len(os.sched_getaffinity(0))))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test marked `alone` runs while the other test process runs nothing: it holds an
    exclusive lock on a file of this run that every other test (setup, call and teardown, so a
    module's deployment starting too) holds shared. Such a test compares timings taken minutes
    apart, a profile then a lone request; with the other process's tests on the same 2 cores
    in one of the two windows, CI saw the prediction off 4.4x one way (profiled under load,
    measured alone) and 6.6x the other."""
    path = _alone_lock_path()
    if path is None:  # one process: nothing else runs beside a test
        return (yield)
    mode = fcntl.LOCK_EX if item.get_closest_marker("alone") else fcntl.LOCK_SH
    with open(path, "a") as lock:
        fcntl.flock(lock, mode)
        return (yield)


def _alone_lock_path() -> Path | None:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    return None if run is None else Path(tempfile.gettempdir()) / f"pdserve-tests-{run}.lock"


def pytest_sessionfinish(session):
    """A test process that is done removes the run's lock file (the other, if still running,
    runs alone from now on; its next test makes the file again)."""
    path = _alone_lock_path()
    if path is not None:
        path.unlink(missing_ok=True)


# What a test needs that makes it one of the slow end-to-end ones `-m "not e2e"` leaves out: a
# Ray instance (its actors are real processes, 4 to 6 s of CPU each to start).
_STARTS_RAY = frozenset({"ray_session", "ray_cluster"})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark `e2e` every test that starts a deployment or Ray itself: those under tests/e2e and
    those that use the session's Ray (through any fixture); tests that start Ray clusters with
    `ray start` are marked where they are written. Before `-m` reads the marks."""
    for item in items:
        if item.get_closest_marker("e2e") is None and (item.path.parent.name == "e2e" or _STARTS_RAY & set(item.fixturenames)):
            item.add_marker(pytest.mark.e2e)


def pytest_sessionstart(session):
    """Build the CPU attention kernels once, before any engine or actor wants it (a fresh
    machine compiles it in about 25 s; every later process loads the cached build)."""
    from engine import native_kernels

    native_kernels.kernel()


# Ray's log monitor, which relays worker output to drivers, globs the session's log directory
# ten times a second while it holds fewer than a thousand files: 5% of a core once a few hundred
# workers have come and gone (1.46 CPU-s in 30 s idle, measured here; 0.59 with these). No driver
# in the tests takes worker output (log_to_driver=False), so it looks for new files once a minute.
_QUIET_LOG_MONITOR = {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0", "LOG_NAME_UPDATE_INTERVAL_S": "60"}


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray instance shared by the whole test session; torn down at the end."""
    import ray

    if not ray.is_initialized():
        # The session's Ray listens on loopback only. Its processes take the setting from the
        # environment as they start; it is removed again after, so that the Ray clusters some
        # tests start with `ray start` (several nodes) are not confined to one machine.
        confine_to_loopback()
        # Only this instance's log monitor: the Ray clusters tests start themselves relay as users see.
        with mock.patch.dict(os.environ, _QUIET_LOG_MONITOR):
            ray.init(
                address="local",  # a fresh instance, never one left by `ray start`
                num_cpus=16,  # logical slots: actors in tests hold 1 CPU each, the machine has 2 cores
                include_dashboard=False,
                log_to_driver=False,
                runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
            )
        release_loopback_confinement()
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_cluster(ray_session):
    return ray_session


@dataclass
class E2EModel:
    path: object
    hf_model: object
    vocab_size: int


@pytest.fixture(scope="session")
def e2e_model(tmp_path_factory) -> E2EModel:
    """A small random Llama plus a trained byte-level BPE tokenizer, in one model directory."""
    from tests.checkpoints import build_checkpoint
    from tests.router.tokenizer_builders import BASE_CONFIG, save_model_dir, train_byte_level_bpe

    path = tmp_path_factory.mktemp("e2e_model")
    tokenizer = train_byte_level_bpe(400)
    model = build_checkpoint("llama", path, vocab_size=tokenizer.get_vocab_size(), max_position_embeddings=2048)
    save_model_dir(path, tokenizer, BASE_CONFIG)
    return E2EModel(path, model, tokenizer.get_vocab_size())
