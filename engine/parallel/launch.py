"""Starting a worker's ranks 1..tp-1: the seam between the engine and whatever hosts processes.

An ``LLMEngine`` with tensor_parallel_size > 1 is rank 0; it picks a meeting address and asks
its ``RankLauncher`` to start the other ranks there, then joins the group itself. The workers
launch Ray actors (``workers.ranks``) in the worker's placement group; ``SubprocessRanks`` starts
plain processes on this machine (the engine alone, tests, benchmarks).
"""

from __future__ import annotations

import logging
import multiprocessing
from pathlib import Path
from typing import Protocol

from engine.config import EngineConfig
from engine.parallel.group import GroupAddress

logger = logging.getLogger(__name__)


class RankLauncher(Protocol):
    def start(self, model_path: Path, config: EngineConfig, address: GroupAddress) -> None:
        """Start ranks 1..address.world_size-1 (without waiting for them: rank 0 joins next)."""

    def stop(self) -> None:
        """End the ranks still running (after rank 0 said stop, or to tear a broken group down)."""

    def check_alive(self) -> None:
        """Raise RuntimeError naming the first rank that ended (and why, where known)."""


def _serve_rank(model_path: Path, config: EngineConfig, address: GroupAddress, rank: int) -> None:
    from engine.parallel.rank import ShardRank

    logging.basicConfig(level=logging.WARNING)
    ShardRank(model_path, config, address, rank).serve()


class SubprocessRanks:
    """Ranks as child processes of this one (spawned: a forked torch is not safe)."""

    def __init__(self) -> None:
        self.processes: list[multiprocessing.Process] = []

    def start(self, model_path: Path, config: EngineConfig, address: GroupAddress) -> None:
        context = multiprocessing.get_context("spawn")
        for rank in range(1, address.world_size):
            process = context.Process(target=_serve_rank, args=(model_path, config, address, rank), daemon=True, name=f"tp-rank-{rank}")
            process.start()
            self.processes.append(process)

    def check_alive(self) -> None:
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited with code {process.exitcode}")

    def stop(self, timeout_s: float = 10.0) -> None:
        for process in self.processes:
            process.join(timeout_s)
            if process.is_alive():
                logger.warning("rank process %s did not stop; killing it", process.name)
                process.kill()
                process.join()
        self.processes.clear()
