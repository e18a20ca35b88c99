"""The load generator's OpenAI-HTTP twin: the same schedule and records, over streamed /v1/completions.

Used to measure an outside server (vLLM's OpenAI server) with the very code that measures
pdserve: ``OpenAIClient`` inherits ``BenchClient``'s arrival schedule, concurrency cap and
warm-up, and fills the same ``RequestRecord`` that ``cluster.bench.metrics`` turns into TTFT,
TPOT and ITL. Only sending one request differs.

A request's life here: POST /v1/completions with the prompt as a list of token ids (so the
server tokenizes nothing and both systems see the same ids), ``stream`` on and usage in every
chunk (``continuous_usage_stats``). Each server-sent event that adds completion tokens is one
timestamped chunk; how many tokens it added comes from the cumulative usage, since a token's
text can be empty (a byte of a multi-byte character, an id the tokenizer cannot render).
Servers that send no per-chunk usage are counted one token per choice chunk and corrected by
the final usage. Errors (HTTP status, an ``error`` event, a broken connection) are recorded,
never raised.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import aiohttp

from cluster.bench.client import FINISHED_OK, BenchClient, ClientConfig, RequestRecord
from cluster.bench.workloads import BenchRequest, ModelLimits

logger = logging.getLogger(__name__)


class OpenAIClient(BenchClient):
    """``BenchClient`` against an OpenAI-compatible server at ``config.address`` (a base URL)."""

    def __init__(self, config: ClientConfig, model: str | None = None, seed: int | None = 0, model_dir: Path | None = None):
        super().__init__(config)
        self.base_url = config.address.rstrip("/")
        if not self.base_url.startswith(("http://", "https://")):
            self.base_url = "http://" + self.base_url
        self.model = model  # None: the first model the server lists
        self.seed = seed
        self.max_model_len: int | None = None
        # An OpenAI server reports its context length but not its vocabulary: that comes
        # from the checkpoint it serves.
        self.model_dir = model_dir
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "OpenAIClient":
        # No connection cap: every request of a burst must be in flight at once, as with gRPC.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None))
        try:
            await self._read_models()
        except BaseException:
            await self._session.close()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self._session.close()

    async def _read_models(self) -> None:
        async with self._session.get(f"{self.base_url}/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as response:
            response.raise_for_status()
            listing = await response.json()
        models = listing.get("data") or []
        if self.model is None:
            if not models:
                raise RuntimeError(f"{self.base_url}/v1/models lists no model")
            self.model = models[0]["id"]
        for entry in models:
            if entry.get("id") == self.model and entry.get("max_model_len"):
                self.max_model_len = int(entry["max_model_len"])

    async def model_limits(self, timeout_s: float = 30.0) -> ModelLimits:
        """The served model's limits: vocabulary from ``model_dir``, context from /v1/models when listed."""
        if self.model_dir is None:
            raise ValueError("model_dir: an OpenAI server does not report its vocabulary; give the served model's directory")
        return ModelLimits.from_model_dir(self.model_dir, self.max_model_len)

    def request_body(self, request: BenchRequest) -> dict[str, Any]:
        """The /v1/completions body for ``request`` (token-id prompt, streamed, usage per chunk)."""
        if request.prompt_token_ids is not None:
            prompt: Any = list(request.prompt_token_ids)
        else:
            prompt = request.prompt_text
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": request.max_tokens,
            "temperature": self.config.temperature,
            "ignore_eos": self.config.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        if self.config.n > 1:
            # Every choice's chunks count, a token each; the last usage (all choices') settles the
            # total. (Per-chunk usage is one choice's on one server and the request's on another.)
            body["n"] = self.config.n
            body["stream_options"] = {"include_usage": True}
        if self.seed is not None:
            body["seed"] = self.seed
        return body

    async def _send(self, index: int, request: BenchRequest, scheduled_s: float, req_id: str | None = None) -> RequestRecord:
        req_id = req_id or f"{self.config.request_id_prefix}-{index}"
        record = RequestRecord(index=index, req_id=req_id, tag=request.tag, prompt_len=request.prompt_len, max_tokens=request.max_tokens, scheduled_s=scheduled_s)
        stream = _StreamState()
        record.send_s = self.now_s()
        try:
            async with asyncio.timeout(self.config.timeout_s):
                async with self._session.post(f"{self.base_url}/v1/completions", json=self.request_body(request), headers={"X-Request-Id": req_id}) as response:
                    if response.status != 200:
                        detail = (await response.text())[:500]
                        record.error = f"HTTP {response.status}: {detail}"
                    else:
                        async for raw in response.content:
                            received = self.now_s()
                            if stream.feed(raw.decode("utf-8", "replace"), record, received):
                                break
        except TimeoutError:
            record.error = f"DEADLINE_EXCEEDED: no end of stream after {self.config.timeout_s:g} s"
        except aiohttp.ClientError as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        record.end_s = self.now_s()
        stream.finish(record)
        if record.error:
            logger.debug("request %s failed: %s", req_id, record.error)
        return record


class _StreamState:
    """Turns a completion stream's server-sent events into a record's chunks, usage and end."""

    def __init__(self) -> None:
        self.counted = 0  # completion tokens already attributed to chunks
        self.final_usage: dict[str, int] | None = None
        self.done = False

    def feed(self, line: str, record: RequestRecord, received_s: float) -> bool:
        """Take one line of the stream; True once ``data: [DONE]`` arrived."""
        line = line.strip()
        if not line.startswith("data:"):
            return False  # blank separators, comments, ``event:`` lines
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            self.done = True
            return True
        try:
            event = json.loads(payload)
        except json.JSONDecodeError:
            record.error = f"bad event in stream: {payload[:200]}"
            return True
        if "error" in event:
            error = event["error"]
            record.error = f"SERVER_ERROR: {error.get('message', error) if isinstance(error, dict) else error}"
            return True
        usage = event.get("usage")
        if usage:
            self.final_usage = usage
        choices = event.get("choices") or []
        if not choices:
            return False  # the usage-only chunk at the end
        choice = choices[0]
        if usage and "completion_tokens" in usage:
            added = int(usage["completion_tokens"]) - self.counted
        else:
            added = 1 if (choice.get("text") or choice.get("token_ids")) else 0
        if added > 0:
            record.chunk_s.append(received_s)
            record.chunk_tokens.append(added)
            self.counted += added
        if choice.get("finish_reason"):
            record.finish_reason = str(choice["finish_reason"])
        return False

    def finish(self, record: RequestRecord) -> None:
        if self.final_usage:
            record.usage_completion_tokens = int(self.final_usage.get("completion_tokens", 0))
            if self.final_usage.get("prompt_tokens"):
                record.prompt_len = int(self.final_usage["prompt_tokens"])
            # Without per-chunk usage the count per chunk was a guess; the total is not.
            missing = record.usage_completion_tokens - sum(record.chunk_tokens)
            if missing > 0 and record.chunk_tokens:
                record.chunk_tokens[-1] += missing
        if not record.error and not (self.done or record.finish_reason):
            record.error = "stream ended without a final message"
        elif not record.error and not record.finish_reason:
            record.error = "stream ended without a finish reason"
        elif not record.error and record.finish_reason not in FINISHED_OK:
            record.error = f"{record.finish_reason.upper()}: the server ended the request"
