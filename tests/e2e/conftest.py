"""End-to-end tests use the shared fixtures of tests/conftest.py and helpers of tests/serving.py.

The HTTP API modules each start their own ``deployment`` (module scope); these reach it."""

import openai
import pytest


@pytest.fixture(scope="module")
def base_url(deployment):
    """The module deployment's OpenAI-compatible API."""
    return f"http://127.0.0.1:{deployment.http_port}/v1"


@pytest.fixture(scope="module")
def client(base_url):
    """The official ``openai`` client of that API (a module may define its own ``client``)."""
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60) as client:
        yield client
