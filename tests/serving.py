"""Helpers for tests that run a real deployment: Ray actors, NIXL, a gRPC client.

The model (fixture ``e2e_model`` in tests/conftest.py) is a small random-weight Llama with a
trained byte-level BPE tokenizer in the same directory, so the router tokenizes and
detokenizes real text and transformers gives the reference outputs.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace

import grpc

from cluster.deployment import Deployment, DeploymentSpec, PoolSpec, build_router
from cluster.pool_follower import PoolFollower
from cluster.pools import PoolManager
from router.front_ends import FrontEnds
from router.responses_api.board import router_name
from router.runner import LoopThread
from engine import EngineConfig
from router.api.pdserve.v1 import generation_pb2 as pb
from router.api.pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.config import RouterConfig

def engine_config(**overrides) -> EngineConfig:
    fields = dict(num_kv_blocks=256, max_num_batched_tokens=64, long_prefill_chunk=32, num_threads=1)
    fields.update(overrides)
    return EngineConfig(**fields)


@contextlib.contextmanager
def running_deployment(model, num_prefill: int, num_decode: int, router: RouterConfig, metrics=None, **overrides):
    spec = DeploymentSpec(
        model_path=model.path,
        prefill=PoolSpec(num_prefill, overrides.pop("prefill_engine", engine_config()), num_cpus=0.5),
        decode=PoolSpec(num_decode, overrides.pop("decode_engine", engine_config()), num_cpus=0.5),
        router=router,
        **overrides,
    )
    deployment = Deployment(spec, metrics)
    deployment.start()
    try:
        yield deployment
    finally:
        deployment.stop()


@contextlib.contextmanager
def following_router(deployment: Deployment, router: RouterConfig, responses_board=None):
    """A router with its own configuration over ``deployment``'s workers, which must be durable
    (``durable_workers``): it follows the pools as a router replica does, so tests that differ
    only in how they route share one set of worker processes (each start is seconds of CPU).
    ``responses_board``: the /v1/responses board it shares with other routers (None: its own)."""
    hosted = HostedRouter(replace(deployment.spec, router=router), responses_board)
    try:
        hosted.start_pools(manage=False)
        yield hosted
    finally:
        hosted.close()


@dataclass
class Stream:
    """Everything one Generate stream delivered."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    messages: list = field(default_factory=list)
    arrival_times: list[float] = field(default_factory=list)

    @property
    def last(self):
        return self.messages[-1]


class Client:
    def __init__(self, address: str, admin_address: str | None = None, own_connection: bool = False):
        # own_connection: a TCP connection of its own (grpc shares one per address by default),
        # as separate client machines would have.
        self.channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)] if own_connection else None)
        self.stub = pb_grpc.GenerationStub(self.channel)
        # Admin listens on its own port.
        self.admin_channel = grpc.insecure_channel(admin_address) if admin_address else None
        self.admin = pb_grpc.AdminStub(self.admin_channel) if admin_address else None

    def generate(self, timeout: float | None = 60, **request) -> Stream:
        stream = Stream()
        for message in self.stub.Generate(make_request(**request), timeout=timeout):
            stream.messages.append(message)
            stream.arrival_times.append(time.monotonic())
            stream.token_ids.extend(message.token_ids)
            stream.text += message.text
        return stream

    def status(self):
        return self.stub.GetClusterStatus(pb.GetClusterStatusRequest()).workers

    def wait_until_idle(self, timeout_s: float = 20.0):
        """Poll GetClusterStatus until no worker holds a block or a sequence; return the statuses."""
        deadline = time.monotonic() + timeout_s
        while True:
            workers = self.status()
            if all(w.num_kv_blocks_used == 0 and w.num_running_seqs == 0 and w.queue_depth == 0 for w in workers):
                return workers
            if time.monotonic() > deadline:
                raise AssertionError(f"workers still hold work: {workers}")
            time.sleep(0.05)

    def close(self):
        self.channel.close()
        if self.admin_channel is not None:
            self.admin_channel.close()


def wait_for_assigned_prompt_tokens(record, at_least: int, timeout_s: float = 30.0) -> int:
    """Wait until the router has given worker ``record`` that many prompt tokens still in
    progress (or the time is up); return how many it has."""
    deadline = time.monotonic() + timeout_s
    while record.num_assigned_prompt_tokens < at_least and time.monotonic() < deadline:
        time.sleep(0.005)
    return record.num_assigned_prompt_tokens


def kill_during_greedy_burst(client: "Client", deployment, prompts: list[list[int]], kill, max_tokens: int = 6, timeout_s: float = 180) -> tuple[list["Stream"], int]:
    """Send every prompt at once (greedy), call ``kill()`` once prefill-0 holds 1,000 prompt tokens
    in progress, and return the streams and how many prompt tokens prefill-0 held then."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(client.generate, prompt_token_ids=p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True) for p in prompts]
        in_progress = wait_for_assigned_prompt_tokens(deployment.router.pool.workers["prefill-0"], 1000)
        kill()
        return [f.result(timeout=timeout_s) for f in futures], in_progress


def make_request(prompt_token_ids=None, prompt_text=None, request_id: str = "", lora_name: str | None = None, **sampling) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=request_id, sampling=pb.SamplingParams(**sampling), lora_name=lora_name)
    if prompt_token_ids is not None:
        request.prompt_token_ids.extend(prompt_token_ids)
    if prompt_text is not None:
        request.prompt_text = prompt_text
    return request


class HostedRouter:
    """A router serving on 127.0.0.1 from a background loop, with no worker yet."""

    def __init__(self, spec: DeploymentSpec, responses_board=None, replica_index: int = 0):
        self.spec = spec
        self.loop = LoopThread()
        self.router = self.loop.run(self._build())
        self.router.responses_board = responses_board
        if replica_index:  # named on the board as replica ``replica_index`` (cluster/router_replica.py)
            self.router.board_name, self.router.deployment_routers = router_name(replica_index), None
        self.front_ends = FrontEnds(self.router)
        self.pools: PoolManager | None = None
        try:
            self.address = f"127.0.0.1:{self.loop.run(self.front_ends.start())}"
        except BaseException:
            self.close()  # a listener that did start, the router and the loop: nothing left behind
            raise
        self.admin_address = None if self.front_ends.admin_port is None else f"127.0.0.1:{self.front_ends.admin_port}"

    @property
    def http_port(self) -> int | None:
        return self.front_ends.http_port

    @property
    def handles(self) -> dict[str, object]:
        """The workers' actor handles (as ``Deployment.handles``), once ``start_pools`` ran."""
        return self.pools.handles

    async def _build(self):
        return build_router(self.spec)

    def start_pools(self, manage: bool = True) -> None:
        """Run the pools (``manage``), or follow those another router runs."""
        if manage:
            self.pools = PoolManager(self.spec, self.router)
        else:
            self.pools = PoolFollower(self.spec.name, self.router, self.spec.health_interval_s, self.spec.health_timeout_s)
        self.router.pool_manager = self.pools
        self.loop.run(self.pools.start(), timeout_s=120)

    def crash(self) -> None:
        """Stop the router's event loop where it stands, as if its process died (nothing of it
        cleans up: its requests are the workers' to drop once it is silent)."""
        self.loop.stop()

    def close(self) -> None:
        self.loop.run(self.router.stop(), timeout_s=30)
        self.loop.run(self.front_ends.stop(), timeout_s=30)
        if self.pools is not None:
            self.loop.run(self.pools.stop(), timeout_s=30)
        self.loop.stop()
