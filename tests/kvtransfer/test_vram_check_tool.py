"""tools/nixl_vram_check.py, the GPU's two-process NIXL check, over DRAM here: the same handshake,
reservation, push and readiness through KVAgent between two processes, byte-exact."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_two_process_transfer_check_moves_every_block_byte_exact(tmp_path):
    out = tmp_path / "nixl.json"
    subprocess.run([sys.executable, str(ROOT / "tools" / "nixl_vram_check.py"), "--device", "cpu", "--blocks", "8", "--json", str(out)],
                   check=True, timeout=120, capture_output=True)
    result = json.loads(out.read_text())
    assert result["ok"] and result["blocks"] == 8 and result["bytes"] == 8 * 28 * 2 * 2 * 16 * 128 * 2
    # Three transfers of new bytes into the same blocks, each byte-exact: the first, and the
    # steady cost of the later ones.
    assert len(result["rounds"]) == 3 and all(r["ok"] for r in result["rounds"]) and result["steady_seconds"] > 0
