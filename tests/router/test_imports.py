"""The router process loads no torch and no model code: a router replica starts in a second,
on a node with no accelerator, and its memory is the router's own."""

from __future__ import annotations

import json
import subprocess
import sys

# Every module a router (or a router replica) runs.
ROUTER_MODULES = [
    "router.core",
    "router.front_ends",
    "router.grpc_api",
    "router.openai_api.server",
    "router.session",
    "router.dispatcher",
    "cluster.router_replica",
]

HEAVY = ("torch", "transformers", "nixl", "nixl_cu12")
ENGINE_CODE = ("engine.llm_engine", "engine.model", "engine.model_runner", "engine.loader", "engine.config", "engine.sequence", "engine.executor")
WORKER_CODE = ("prefill_workers.worker", "decode_workers.worker", "kvtransfer.agent", "workers.base")


def test_the_router_modules_import_no_torch_no_model_and_no_worker_code():
    script = (
        "import json, sys\n"
        + "".join(f"import {name}\n" for name in ROUTER_MODULES)
        + "print(json.dumps(sorted(sys.modules)))\n"
    )
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout))
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))
    assert not loaded & set(ENGINE_CODE), sorted(loaded & set(ENGINE_CODE))
    assert not loaded & set(WORKER_CODE), sorted(loaded & set(WORKER_CODE))
