"""A NIXL KV transfer between two processes on one GPU's memory, through pdserve's KVAgent.

    python tools/nixl_vram_check.py [--device cuda] [--blocks 256] [--json out.json]

The prefill side (one process) owns a block-major KV tensor in device memory (VRAM registered
with NIXL), writes its blocks with CUDA kernels, records a CUDA event behind them and waits on
it (what ``PrefillWorker`` does before a push: NIXL reads memory, not the stream), then pushes
``--blocks`` blocks into blocks the decode side (a second process, its own KV tensor) reserved;
the decode side polls until the request is ready. Checked: every destination block's bytes
equal its source block's (digests), and the write's bandwidth is reported, for the first
transfer (which sets the transport up) and the fastest of the later ones (``--rounds``). Blocks have the
1.5B shape's size (28 layers, 2 KV heads, head size 128, 16 tokens, bfloat16: 448 KiB).

``--device cpu`` runs the same over DRAM (the CPU test machine's path), to check the script.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COMPAT_FIELDS = dict(model_id="check/1.5b-shape", dtype="bfloat16", num_layers=28, num_kv_heads=2, head_dim=128, block_size=16)
REQ_ID = "vram-check"


def _digests(raw, block_ids: list[int]) -> list[str]:
    host = raw[block_ids].cpu()
    return [hashlib.blake2b(host[i].numpy().tobytes(), digest_size=8).hexdigest() for i in range(len(block_ids))]


def _agent(name: str, device: str, num_blocks: int):
    import torch

    from kvtransfer import KVAgent, KVCompat, KVTransferConfig

    compat = KVCompat(**COMPAT_FIELDS)
    kv = torch.zeros((num_blocks, *compat.block_shape()), dtype=torch.bfloat16, device=device)
    raw = kv.view(num_blocks, -1).view(torch.uint8)
    return KVAgent(name, kv, compat, KVTransferConfig()), raw


def decode_side(pipe, device: str, num_blocks: int, rounds: int, timeout_s: float) -> None:
    agent, raw = _agent("D0", device, num_blocks)
    pipe.send(agent.handshake_offer())
    dst = pipe.recv()
    for round_index in range(rounds):
        req_id = f"{REQ_ID}-{round_index}"
        pipe.send(agent.reserve(req_id, dst, lease_s=timeout_s))
        deadline = time.monotonic() + timeout_s
        while not agent.ready(req_id) and time.monotonic() < deadline:
            events = agent.poll_receives()
            if events.failed:
                pipe.send({"error": [str(e) for e in events.failed]})
                pipe.recv()
                agent.close()
                return
        ready_at = time.monotonic()
        ready = agent.ready(req_id)
        pipe.send({"ready": ready, "ready_at": ready_at, "digests": _digests(raw, dst) if ready else []})
        if not ready:
            break
        agent.complete(req_id)
    pipe.recv()  # the prefill side is done with its agent
    agent.close()


def prefill_side(pipe, device: str, num_blocks: int, src: list[int], rounds: int, timeout_s: float) -> None:
    import torch

    agent, raw = _agent("P0", device, num_blocks)
    offer = pipe.recv()
    agent.connect(offer)
    for round_index in range(rounds):
        dest = pipe.recv()
        if dest == "done":  # the run ended early (the decode side failed)
            agent.close()
            return
        # The "step": random bytes written by kernels on the device's stream.
        generator = torch.Generator(device=device).manual_seed(7 + round_index)
        raw[src] = torch.randint(0, 256, (len(src), raw.shape[1]), generator=generator, dtype=torch.uint8, device=device)
        if device.startswith("cuda"):
            done = torch.cuda.Event()
            done.record()
            done.synchronize()  # the push rule: the step's writes are in memory before NIXL reads it
        want = _digests(raw, src)
        start = time.monotonic()
        agent.push(f"{REQ_ID}-{round_index}", dest, src, list(dest.block_ids), len(src))
        deadline = start + timeout_s
        events = []
        while agent.num_in_flight() and time.monotonic() < deadline:
            events.extend(agent.poll_sends())
        events.extend(agent.poll_sends())
        pipe.send({"digests": want, "start": start, "in_flight": agent.num_in_flight(), "events": [repr(e) for e in events][-3:]})
    pipe.recv()  # the run's end
    agent.close()


def run(device: str, num_blocks_moved: int, timeout_s: float, rounds: int = 3) -> dict:
    """``rounds`` transfers of the same blocks between the same two agents: the first pays what a
    first write between two processes sets up (the transport's connection, memory handles); the
    others are what a serving deployment's writes cost."""
    import torch

    from kvtransfer import KVCompat

    block_bytes = KVCompat(**COMPAT_FIELDS).bytes_per_block
    num_blocks = 2 * num_blocks_moved + 8
    # Scattered source and destination blocks, as a real prompt's are.
    src = list(range(1, 2 * num_blocks_moved, 2))
    dst = list(range(num_blocks - 2, num_blocks - 2 - 2 * num_blocks_moved, -2))
    context = mp.get_context("spawn")
    d_pipe, d_child = context.Pipe()
    p_pipe, p_child = context.Pipe()
    decode = context.Process(target=decode_side, args=(d_child, device, num_blocks, rounds, timeout_s))
    prefill = context.Process(target=prefill_side, args=(p_child, device, num_blocks, src, rounds, timeout_s))
    decode.start()
    prefill.start()
    moved = len(src) * block_bytes
    done: list[dict] = []
    error = None
    try:
        p_pipe.send(d_pipe.recv())  # the decode side's handshake offer
        d_pipe.send(dst)
        for _ in range(rounds):
            p_pipe.send(d_pipe.recv())  # the decode side's reservation for this round
            sent = p_pipe.recv()
            received = d_pipe.recv()
            if "error" in received:
                error = received["error"]
                break
            seconds = received["ready_at"] - sent["start"]
            done.append({
                "ok": bool(received["ready"]) and received["digests"] == sent["digests"],
                "seconds": seconds,
                "gb_s": moved / seconds / 1e9 if seconds > 0 else None,
                "sender_in_flight_at_end": sent["in_flight"],
                "last_send_events": sent["events"],
            })
            if not done[-1]["ok"]:
                break
    finally:
        for pipe in (p_pipe, d_pipe):
            try:
                pipe.send("done")
            except Exception:
                pass
        for process in (prefill, decode):
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    if error is not None:
        return {"ok": False, "device": device, "error": error, "rounds": done}
    first = done[0] if done else {}
    later = [r["seconds"] for r in done[1:] if r["seconds"] > 0]
    return {
        "ok": len(done) == rounds and all(r["ok"] for r in done),
        "device": device if device == "cpu" else torch.cuda.get_device_name(),
        "blocks": len(src),
        "bytes": moved,
        "seconds": first.get("seconds"),  # the first transfer, set-up included
        "gb_s": first.get("gb_s"),
        "steady_seconds": min(later) if later else None,  # the fastest later one: a deployment's writes
        "steady_gb_s": moved / min(later) / 1e9 if later else None,
        "rounds": done,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--blocks", type=int, default=256, help="blocks moved (448 KiB each)")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--rounds", type=int, default=3, help="transfers of the same blocks (the first sets the transport up)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = run(args.device, args.blocks, args.timeout, args.rounds)
    print(json.dumps(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
