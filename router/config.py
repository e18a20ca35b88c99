"""How the router routes, queues and retries."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path

from router.openai_api.parser_names import REASONING_PARSERS, TOOL_CALL_PARSERS
from router.pipeline import PipelineMode
from router.pool import RoutingPolicy


# The most workers one pool may have (a config's replicas, the admin API's ScalePool).
MAX_POOL_REPLICAS = 256


class Disaggregation(str, enum.Enum):
    AUTO = "auto"  # conditional: the decode actor prefills short prompts, or when prefill is busy
    ALWAYS = "always"  # every prompt goes through a prefill actor (when there is one)
    NEVER = "never"  # aggregated: decode actors prefill everything themselves


@dataclass(slots=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    # Admin (ScalePool, DrainWorker) listens on its own address, loopback by default, so
    # exposing Generate never exposes it; admin_port None turns Admin off.
    admin_host: str = "127.0.0.1"
    admin_port: int | None = 0
    # The OpenAI-compatible HTTP API (router/openai_api/); http_port None turns it off.
    http_host: str = "127.0.0.1"
    http_port: int | None = 0
    # Names a request's "model" may give (the first is what responses say); None: the model
    # directory's name.
    served_model_names: list[str] | None = None
    # Prefix of every Prometheus series' name (router.metrics): "pdserve:" or vLLM's "vllm:".
    metrics_prefix: str = "pdserve:"
    # Origins whose browser pages may call the HTTP API (CORS; vLLM's --allowed-origins): "*" any.
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    # vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (router.lora_adapters): off
    # by default, since a load reads any directory the workers can see.
    allow_runtime_lora_updating: bool = False
    # /v1/responses with store (router/responses_api/store.py): how many stored responses are
    # kept, for how long, and the JSON-lines file that keeps them across restarts (None: memory only).
    responses_store_size: int = 10_000
    responses_store_ttl_s: float = 3600.0
    responses_store_max_bytes: int = 1 << 30  # their JSON; the oldest go first past it
    responses_store_path: Path | None = None
    # Fields a request leaves unset take the model's generation_config.json values
    # (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), as vLLM does.
    model_sampling_defaults: bool = True
    # With a token, Generation and Admin calls must carry "authorization: Bearer <token>".
    auth_token: str | None = field(default=None, repr=False)
    # With both, the listeners speak TLS only.
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    # kv_aware: each worker is scored by the prompt prefix its cache holds against its load
    # (router.routing); least_loaded and round_robin ignore caches.
    routing_policy: RoutingPolicy = RoutingPolicy.KV_AWARE
    # kv_aware: what a cached prompt token is worth against a token of queued work (0: least loaded).
    kv_overlap_weight: float = 1.0
    disaggregation: Disaggregation = Disaggregation.AUTO
    # AUTO: prompts up to this many tokens are prefilled on the decode actor: a transfer and a
    # second hop cost more than a few tokens of compute there.
    local_prefill_max_tokens: int = 32
    # The n choices of one prompt: the first is dispatched, the others follow it to its decode
    # actor once its first token came and take the prompt from that actor's prefix cache (its KV
    # moved and held once; measured: disaggregated output tok/s 1.14x, TTFT p99 1.6x in a burst
    # of n = 4 requests). False: each choice is a request of its own.
    share_choice_prompts: bool = True
    # AUTO: when the least busy prefill actor has this many prompt tokens queued, prompts up to
    # ``busy_local_prefill_max_tokens`` are prefilled locally instead of waiting behind them.
    prefill_busy_tokens: int = 8192
    busy_local_prefill_max_tokens: int = 512
    # Distributed split-fuse (router.pipeline): a long prompt prefilled by a pipeline of prefill
    # actors, each a range of layers. AUTO: prompts of at least 2 x ``pipeline_tokens_per_stage``
    # tokens over as many of the least loaded actors as bring its first token soonest (one stage
    # per that many tokens at most; router.pipeline.num_stages); ALWAYS: every remote prompt.
    prefill_pipeline: PipelineMode = PipelineMode.AUTO
    max_pipeline_stages: int | None = None  # None: as many as the prefill pool has
    # Whether the request's decode actor computes the last stage of a pipeline (its layers
    # straight into its reservation). AUTO: while it has no other request; ALWAYS: every pipeline.
    pipeline_decode_stage: PipelineMode = PipelineMode.AUTO
    pipeline_tokens_per_stage: int = 512
    pipeline_chunk_tokens: int = 512  # the largest chunks that flow through the stages (router.pipeline.chunk_tokens)
    max_queued_requests: int = 256  # requests admitted but without a first token; beyond: RESOURCE_EXHAUSTED
    max_prefill_retries: int = 2  # another prefill actor after one died mid-request
    max_decode_restarts: int = 2  # restart elsewhere when a decode actor died before the first token
    # Poison detection: a request present at this many worker deaths is refused, not carried to
    # yet another worker (1 would refuse every bystander of a single crash).
    max_worker_deaths_per_request: int = 2
    # Lease of a decode reservation. The router renews it every quarter of this while the
    # request's KV is coming, so only a router or writer that vanished lets it run out.
    kv_lease_s: float = 30.0
    # How long a request may wait at the router for decode KV room; None: until its deadline.
    # Overload is refused up front by the admission budget below, not by waiting and failing.
    capacity_wait_s: float | None = None
    # Refuse at admission (RESOURCE_EXHAUSTED, with a retry hint) a request whose estimated wait
    # for its first token, from measured rates, exceeds this; None: never refuse by estimate.
    admission_ttft_budget_s: float | None = 120.0
    # Priority aging in the router's queue for decode room: a request queued this long goes
    # ahead of every priority, oldest first (the engines age their own queues the same way,
    # EngineConfig.priority_max_wait_s). None: strict priority, which can starve.
    priority_max_wait_s: float | None = 30.0
    ready_wait_s: float = 120.0  # how long a request may wait for the deployment to become ready
    # A decode actor that has not heard from this router for this long (it polls every
    # output_poll_s while it has requests there) takes it for dead and frees its requests.
    router_lease_s: float = 30.0
    output_poll_s: float = 0.05  # long-poll window of the per-decode-actor output collector
    # Tokens per streamed message after the first (vLLM's and SGLang's --stream-interval): 1 sends
    # every decode step's token at once; more cuts the router's cost per token (a message costs
    # about as much as its tokens) at the price of burstier text. Outputs already queued behind
    # a stream's next message always go with it, whatever this is.
    stream_interval: int = 1
    status_timeout_s: float = 5.0
    # How chat answers with tool_choice "auto" are read for tool calls: a format of
    # router/openai_api/tool_formats.py (vLLM's parser names); None: recognised in the chat template.
    tool_call_parser: str | None = None
    # The chat template's text instead of the model's own (vLLM's --chat-template: a template
    # with tool calls, one for a base model); None: the model's (chat_template.jinja or
    # tokenizer_config.json). ``default_chat_template_kwargs``: template variables every chat
    # renders with, under a request's own chat_template_kwargs (vLLM's flag of that name).
    chat_template: str | None = None
    default_chat_template_kwargs: dict | None = None
    # A reasoning model's thinking split off its chat answers: a parser of REASONING_PARSERS
    # (router/openai_api/reasoning.py); None: the answer keeps it, as the model wrote it.
    reasoning_parser: str | None = None

    def validate(self) -> None:
        for name in ("local_prefill_max_tokens", "prefill_busy_tokens", "max_queued_requests", "max_prefill_retries", "max_decode_restarts"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("pipeline_tokens_per_stage", "pipeline_chunk_tokens", "stream_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_pipeline_stages is not None and self.max_pipeline_stages < 1:
            raise ValueError(f"max_pipeline_stages: must be >= 1 or unset, got {self.max_pipeline_stages}")
        if not self.kv_overlap_weight >= 0:
            raise ValueError(f"kv_overlap_weight: must be >= 0, got {self.kv_overlap_weight}")
        if self.max_worker_deaths_per_request < 1:
            raise ValueError(f"max_worker_deaths_per_request: must be >= 1, got {self.max_worker_deaths_per_request}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file: give both or neither")
        if self.chat_template is not None and (not isinstance(self.chat_template, str) or not self.chat_template.strip()):
            raise ValueError("chat_template: must be a template's text (or unset for the model's own)")
        if self.default_chat_template_kwargs is not None and not isinstance(self.default_chat_template_kwargs, dict):
            raise ValueError(f"default_chat_template_kwargs: must map template variables to values, got {type(self.default_chat_template_kwargs).__name__}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser: one of {', '.join(REASONING_PARSERS)} (or unset), got {self.reasoning_parser!r}")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"tool_call_parser: one of {', '.join(TOOL_CALL_PARSERS)} (or unset), got {self.tool_call_parser!r}")
        if self.served_model_names is not None and (not self.served_model_names or not all(isinstance(n, str) and n for n in self.served_model_names)):
            raise ValueError(f"served_model_names: must be non-empty names, got {self.served_model_names!r}")
        if not isinstance(self.allowed_origins, list) or not all(isinstance(o, str) and o.strip() for o in self.allowed_origins):
            raise ValueError(f"allowed_origins: must be a list of origins (scheme://host[:port], or \"*\" for any), got {self.allowed_origins!r}")
        if self.auth_token is not None and not self.auth_token.strip():
            raise ValueError("auth_token: must not be empty")
        for name in ("kv_lease_s", "ready_wait_s", "output_poll_s", "status_timeout_s", "router_lease_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("capacity_wait_s", "admission_ttft_budget_s", "priority_max_wait_s"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0 or unset, got {getattr(self, name)}")
