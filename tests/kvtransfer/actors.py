"""A test-only Ray actor that holds a KVAgent the way prefill and decode workers will.

It owns a block-major KV tensor and a toy free pool (standing in for the engine's block
allocator), and exposes batched calls so tests stay within a few Ray round trips.
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict

import ray
import torch

from kvtransfer import KVAgent, KVCompat, KVTransferConfig, LeasePolicy
from kvtransfer.errors import KVTransferError

# 2 layers x 2 (K,V) x 4 tokens x 2 heads x 32 dims x bf16 = 2 KiB per block.
SMALL_COMPAT = KVCompat("test/tiny", "bfloat16", num_layers=2, num_kv_heads=2, head_dim=32, block_size=4)


def block_digest(raw: torch.Tensor) -> str:
    return hashlib.blake2b(raw.numpy().tobytes(), digest_size=8).hexdigest()


@ray.remote(num_cpus=1)
class KVWorker:
    def __init__(
        self,
        name: str,
        num_blocks: int = 256,
        compat: KVCompat = SMALL_COMPAT,
        backend: str = "nixl",
        lease: LeasePolicy | None = None,
    ) -> None:
        torch.set_num_threads(1)
        self.kv = torch.zeros((num_blocks, *compat.block_shape()), dtype=getattr(torch, compat.dtype))
        self.raw = self.kv.view(num_blocks, -1).view(torch.uint8)
        config = KVTransferConfig(backend=backend, lease=lease or LeasePolicy())
        self.agent = KVAgent(name, self.kv, compat, config)
        self.free = list(range(num_blocks))
        self.progress: dict[str, list[int]] = defaultdict(list)
        self.ready_log: list[tuple[str, int]] = []  # (req_id, num_valid seen when ready)
        self.failed: dict[str, str] = {}
        self.send_log: list = []
        self._extra_agents: list[KVAgent] = []

    # -- setup ---------------------------------------------------------------------------

    def ping(self) -> bool:
        return True

    def ref(self):
        return self.agent.ref

    def offer(self):
        return self.agent.handshake_offer()

    def foreign_offer(self, name: str, compat: KVCompat):
        """An offer from a second, differently configured agent living in this process."""
        kv = torch.zeros((8, *compat.block_shape()), dtype=getattr(torch, compat.dtype))
        agent = KVAgent(name, kv, compat)
        self._extra_agents.append(agent)
        return agent.handshake_offer()

    def connect(self, offer):
        return self.agent.connect(offer)

    def fill(self, block_ids: list[int], seed: int) -> list[str]:
        """Write fresh random bytes into blocks; return their digests in order."""
        gen = torch.Generator().manual_seed(seed)
        ids = torch.tensor(block_ids, dtype=torch.long)
        self.raw[ids] = torch.randint(0, 256, (len(block_ids), self.raw.shape[1]), generator=gen, dtype=torch.uint8)
        return self.digests(block_ids)

    def digests(self, block_ids: list[int]) -> list[str]:
        return [block_digest(self.raw[b]) for b in block_ids]

    # -- prefill side --------------------------------------------------------------------

    def push(self, req_id, dest, src, dst, num_valid) -> int:
        return self.agent.push(req_id, dest, src, dst, num_valid)

    def try_push(self, req_id, dest, src, dst, num_valid) -> KVTransferError | None:
        """Push and return the refusal instead of raising (for tests that expect one)."""
        try:
            self.agent.push(req_id, dest, src, dst, num_valid)
        except KVTransferError as e:
            return e
        return None

    def step(self, pushes: list[tuple], cancels: list[str] = ()) -> dict:
        """Post a batch of pushes, then cancel some requests, then poll once (no waiting)."""
        refused = {}
        for req_id, dest, src, dst, num_valid in pushes:
            try:
                self.agent.push(req_id, dest, src, dst, num_valid)
            except KVTransferError as e:
                refused[req_id] = e
        reports = {req_id: self.agent.cancel(req_id) for req_id in cancels}
        events = self.agent.poll_sends()
        self.send_log.extend(events)
        return {"refused": refused, "reports": reports, "events": events}

    def drain_sends(self, timeout_s: float = 10.0) -> list:
        """Poll until nothing is in flight (bounded); return the events seen."""
        events = []
        deadline = time.monotonic() + timeout_s
        while True:
            events.extend(self.agent.poll_sends())
            if self.agent.num_in_flight() == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.001)
        events.extend(self.agent.poll_sends())
        self.send_log.extend(events)
        return events

    def disconnect(self, peer_name: str) -> list[str]:
        return self.agent.disconnect(peer_name, "the test killed it")

    def poll_sends_once(self) -> tuple[list, int]:
        events = self.agent.poll_sends()
        self.send_log.extend(events)
        return events, self.agent.num_in_flight()

    def quiesce_reports(self, req_ids: list[str]) -> dict:
        return {r: self.agent.quiesce_report(r) for r in req_ids}

    def num_in_flight(self) -> int:
        return self.agent.num_in_flight()

    # -- decode side ---------------------------------------------------------------------

    def reserve(self, req_id: str, num_blocks: int, lease_s: float | None = None):
        ids = self.free[:num_blocks]
        del self.free[:num_blocks]
        return self.agent.reserve(req_id, ids, lease_s)

    def reserve_ids(self, req_id: str, block_ids: list[int], lease_s: float | None = None):
        for b in block_ids:
            self.free.remove(b)
        return self.agent.reserve(req_id, block_ids, lease_s)

    def poll(self) -> list[str]:
        """One poll_receives; record progress, failures and lease frees; return ready ids."""
        events = self.agent.poll_receives()
        for req_id, num_valid in events.progress:
            self.progress[req_id].append(num_valid)
        for req_id in events.ready:
            self.ready_log.append((req_id, self.agent.num_valid_blocks(req_id)))
        for error in events.failed:
            self.failed[error.req_id] = str(error)
        for freed in events.freed:
            self.free.extend(freed.block_ids)
        return list(events.ready)

    def wait_ready(self, req_ids: list[str], timeout_s: float = 10.0) -> list[str]:
        """Poll until every request is ready or the time is up; return the ready ones."""
        want, ready = set(req_ids), []
        deadline = time.monotonic() + timeout_s
        while want and time.monotonic() < deadline:
            for req_id in self.poll():
                if req_id in want:
                    want.discard(req_id)
                    ready.append(req_id)
            time.sleep(0.001)
        return ready

    def poll_for(self, seconds: float) -> list[str]:
        ready = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            ready.extend(self.poll())
            time.sleep(0.005)
        return ready

    def is_ready(self, req_id: str) -> bool:
        return self.agent.ready(req_id)

    def complete(self, req_id: str) -> list[int]:
        ids = self.agent.complete(req_id)
        self.free.extend(ids)
        return ids

    def abort(self, req_id: str) -> list[int]:
        ids = self.agent.abort(req_id)
        self.free.extend(ids)
        return ids

    def confirm(self, req_id: str) -> list[int]:
        ids = self.agent.confirm_quiesced(req_id)
        self.free.extend(ids)
        return ids

    def dstep(self, reserves=(), aborts=(), confirms=(), completes=(), poll_s: float | None = 0.01) -> dict:
        """One decode-side round of the stress test, batched into a single Ray call; ``poll_s``
        None: no poll (a call whose answer the caller does not read must not take ready events)."""
        dests = {}
        for req_id, num_blocks, lease_s in reserves:
            dests[req_id] = self.reserve(req_id, num_blocks, lease_s) if len(self.free) >= num_blocks else None
        for req_id in aborts:
            self.abort(req_id)
        for req_id in confirms:
            self.confirm(req_id)
        for req_id in completes:
            self.complete(req_id)
        if poll_s is None:
            ready = []
        elif poll_s > 0:
            ready = self.poll_for(poll_s)
        else:
            ready = self.poll()  # once (poll_for(0) would not poll at all)
        digests = {r: self.digests(self.agent.receiver.block_ids(r)) for r in ready}
        return {"dests": dests, "ready": ready, "digests": digests, "num_free": len(self.free)}

    def num_free(self) -> int:
        return len(self.free)

    def free_ids(self) -> list[int]:
        return list(self.free)

    def state(self) -> dict:
        return {
            "progress": dict(self.progress),
            "ready": list(self.ready_log),
            "failed": dict(self.failed),
            "late_writes": self.agent.receiver.num_late_writes,
            "reserved": self.agent.receiver.num_reserved_blocks(),
        }
