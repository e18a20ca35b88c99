"""A LoRA adapter's files, carried to the workers so that no node needs a copy of its directory.

An adapter is named by a directory on the machine that configures or loads it (the controller
reads ``lora_modules``; the router reads a runtime load's ``lora_path``). Workers on other nodes
may have no such directory, and where one exists it may by then hold other files: an RL trainer
writes each version of its policy into the same place. So the reader sends the files themselves
(through Ray's object store, once for all workers) and each worker writes them out on its own
node: every worker, whenever it starts, computes with the version that was read.

The files are what the loader reads and the adapter's digest covers (``engine.lora_loading``):
``adapter_config.json`` and the ``*.safetensors`` weights. This module imports no torch: the
router uses it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Where a worker writes the adapters it starts with, by content (the node's workers share them).
NODE_CACHE = Path(tempfile.gettempdir()) / "pdserve-lora"


@dataclass(frozen=True, slots=True)
class AdapterFiles:
    source: str  # the directory they were read from, as it was named
    files: dict[str, bytes]  # file name -> contents

    @classmethod
    def read(cls, directory: str | Path) -> "AdapterFiles | None":
        """The adapter's files, or None where ``directory`` is not a directory here (a Hugging
        Face id, a path only the workers' nodes have: each worker then reads it itself)."""
        path = Path(directory).expanduser()
        if not path.is_dir() or not (path / "adapter_config.json").is_file():
            # No adapter here: each worker reads the name and refuses it with the loader's reason.
            # (Read anyway, a model's directory named by mistake was read whole into memory.)
            return None
        names = ["adapter_config.json", *sorted(p.name for p in path.glob("*.safetensors"))]
        return cls(str(directory), {name: (path / name).read_bytes() for name in names if (path / name).is_file()})

    @property
    def key(self) -> str:
        """A name for these contents."""
        digest = hashlib.sha256()
        for name in sorted(self.files):
            digest.update(name.encode() + b"\0" + hashlib.sha256(self.files[name]).digest())
        return digest.hexdigest()[:32]

    def write_into(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        for name, contents in self.files.items():
            (directory / name).write_bytes(contents)
        return directory

    def on_node(self, cache: Path = NODE_CACHE) -> Path:
        """A directory of this node holding the files, written once per contents: what a worker
        starts with (its tensor-parallel ranks read it as they start, after the worker has)."""
        target = cache / self.key
        if target.is_dir():
            return target
        cache.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=cache, prefix=".writing-"))
        self.write_into(staging)
        try:
            os.rename(staging, target)  # whole or not at all, for the node's other workers
        except OSError:  # another worker of this node wrote it first
            shutil.rmtree(staging, ignore_errors=True)
        return target

    @contextlib.contextmanager
    def written(self) -> Iterator[Path]:
        """A directory holding the files while the block runs, removed after: a runtime load,
        whose ranks have all read it when the load returns."""
        with tempfile.TemporaryDirectory(prefix="pdserve-lora-") as directory:
            yield self.write_into(Path(directory))
