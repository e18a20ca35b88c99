"""The HTTP edge as a browser and vLLM's scripts meet it, with no worker: CORS preflights and
headers (every route, streams too), and /tokenize's token strings."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
from transformers import PreTrainedTokenizerFast

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def hosted(e2e_model):
    from cluster.deployment import DeploymentSpec, PoolSpec
    from router.config import RouterConfig
    from tests.serving import HostedRouter, engine_config

    spec = DeploymentSpec(
        model_path=e2e_model.path, prefill=PoolSpec(0, engine_config()), decode=PoolSpec(1, engine_config()),
        router=RouterConfig(http_port=0, auth_token=TOKEN, ready_wait_s=0.5),
    )
    router = HostedRouter(spec)
    _HOSTED["router"] = router.router
    yield f"http://127.0.0.1:{router.http_port}"
    router.close()


_HOSTED: dict = {}  # the hosted router, for the tests that look inside it


def _call(url: str, method: str = "GET", headers: dict | None = None, body: dict | None = None) -> tuple[int, dict, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


PAGE = "https://chat.example.com"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/messages", "/v1/responses", "/tokenize"])
def test_a_browsers_preflight_is_answered_before_authentication(hosted, path):
    """A browser sends its preflight without the token: it got 401 (or 405), and the page's call
    never went out. vLLM allows any origin, method and header by default."""
    status, headers, _ = _call(hosted + path, "OPTIONS", PREFLIGHT)
    assert status == 204
    assert headers["Access-Control-Allow-Origin"] == "*"
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert {"authorization", "content-type"} <= {h.strip().lower() for h in headers["Access-Control-Allow-Headers"].split(",")}


def test_every_answer_tells_a_browser_any_origin_may_read_it(hosted):
    """A page reads an answer (an error too: 401, 503) only if it names its origin or "*"."""
    origin = {"Origin": PAGE}
    status, headers, body = _call(hosted + "/v1/models", headers={**origin, "Authorization": f"Bearer {TOKEN}"})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "*" and json.loads(body)["data"]
    status, headers, _ = _call(hosted + "/v1/models", headers=origin)
    assert status == 401 and headers["Access-Control-Allow-Origin"] == "*"
    status, headers, _ = _call(hosted + "/v1/completions", "POST", {**origin, "Authorization": f"Bearer {TOKEN}"}, {"prompt": "hi", "max_tokens": 2})
    assert status == 503 and headers["Access-Control-Allow-Origin"] == "*"
    # An OPTIONS that is no preflight needs no token either (vLLM's auth skips OPTIONS): 405.
    status, headers, _ = _call(hosted + "/v1/models", "OPTIONS", origin)
    assert status == 405 and headers["Access-Control-Allow-Origin"] == "*"


def test_allowed_origins_limit_which_pages_may_read_answers_streams_too():
    """With router.allowed_origins naming pages, only those get the header (their own origin
    named, Vary: Origin); another page's preflight is refused. A streamed answer carries it too,
    from its first byte."""
    from aiohttp import ClientSession, web
    from aiohttp.test_utils import TestServer

    from router import sse
    from router.config import RouterConfig
    from router.openai_api.server import OpenAIServer

    server = OpenAIServer(SimpleNamespace(config=RouterConfig(allowed_origins=[PAGE])), "127.0.0.1", 0, ["m"], auth_token=TOKEN, chat=SimpleNamespace())

    async def events(request: web.Request) -> web.StreamResponse:
        response = sse.event_stream()
        await response.prepare(request)
        await sse.send(response, {"n": 1})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def run() -> list:
        app = server.application()
        app.router.add_get("/v1/events", events)
        seen = []
        async with TestServer(app) as test_server, ClientSession() as client:
            url = str(test_server.make_url("/v1/events"))
            for origin in (PAGE, "https://other.example"):
                auth = {"Origin": origin, "Authorization": f"Bearer {TOKEN}"}
                async with client.get(url, headers=auth) as response:
                    seen.append((origin, response.status, response.headers.get("Access-Control-Allow-Origin"), response.headers.get("Vary"), await response.text()))
                async with client.options(url, headers={**PREFLIGHT, "Origin": origin}) as response:
                    seen.append((origin, "preflight", response.status, response.headers.get("Access-Control-Allow-Origin")))
        return seen

    ours, our_preflight, other, other_preflight = asyncio.run(run())
    assert ours[1:4] == (200, PAGE, "Origin") and ours[4].endswith("data: [DONE]\n\n")
    assert our_preflight[2:] == (204, PAGE)
    assert other[1:3] == (200, None)  # served (CORS is the browser's to enforce), not readable by the page
    assert other_preflight[2:] == (400, None)


def test_tokenize_returns_the_vocabularys_pieces_as_vllm_does(hosted, e2e_model):
    """return_token_strs names each token as transformers' convert_ids_to_tokens does ("ĠðŁ"),
    where it gave each token's text alone (" \ufffd" for a piece of an emoji)."""
    reference = PreTrainedTokenizerFast.from_pretrained(e2e_model.path)
    status, _, body = _call(hosted + "/tokenize", "POST", {"Authorization": f"Bearer {TOKEN}"}, {"prompt": "hi 😀 there", "return_token_strs": True})
    answer = json.loads(body)
    assert status == 200 and answer["token_strs"] == reference.convert_ids_to_tokens(answer["tokens"])
    assert not any("\ufffd" in piece for piece in answer["token_strs"])


def test_tokenize_and_detokenize_are_bounded_as_a_prompt_is(hosted):
    """Unbounded, one /tokenize of tens of megabytes held the shared tokenizing thread for a
    minute and gigabytes of memory, and a /detokenize of millions of ids stalled the event loop."""
    status, _, body = _call(hosted + "/tokenize", "POST", {}, {"prompt": "x" * 10_000_000})
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == "prompt" and "characters" in error["message"]
    status, _, body = _call(hosted + "/detokenize", "POST", {}, {"tokens": [1] * 1_000_000})
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == "tokens" and "context" in error["message"]


def test_a_token_that_is_no_utf8_is_refused_as_a_wrong_token(hosted):
    """Non-UTF-8 bytes in the Authorization header: a 500, with a traceback logged for each."""
    import http.client
    from urllib.parse import urlsplit

    address = urlsplit(hosted)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=10)
    connection.putrequest("GET", "/v1/models")
    connection.putheader("Authorization", b"Bearer \xff\xfe")
    connection.endheaders()
    response = connection.getresponse()
    assert response.status == 401 and json.loads(response.read())["error"]["code"] == "invalid_api_key"
    connection.close()


def test_the_choices_of_a_prompt_tokenize_it_once(hosted, monkeypatch):
    """n choices of one long prompt were each validated alone: the prompt was tokenized n times
    on the router's shared tokenizing thread."""
    tokenizer = _HOSTED["router"].tokenizer
    prompts = []
    encode = tokenizer.encode

    def counted(text, *args, **kwargs):
        prompts.append(text)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", counted)
    prompt = "the same prompt " * 6
    body = {"prompt": prompt, "n": 8, "max_tokens": 2, "bad_words": ["alpha", "beta", "gamma"]}  # (each encoded twice per choice too)
    _call(hosted + "/v1/completions", "POST", {"Authorization": f"Bearer {TOKEN}"}, body)
    assert prompts.count(prompt) == 1
