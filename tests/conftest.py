"""Fixtures shared by every test package: one local Ray instance per test session."""

from __future__ import annotations

import os

import pytest

# One torch thread per process keeps 2-core CI machines from oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray instance shared by the whole test session; torn down at the end."""
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=16,  # logical slots: actors in tests hold 1 CPU each, the machine has 2 cores
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
        )
    yield ray
    ray.shutdown()
