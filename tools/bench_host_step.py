"""The host's share of a decode step: an engine over a tiny model (2 layers, hidden 64, a
1,024-token vocabulary) on the CPU, so what is left of ``engine.step()`` beside the model is the
Python around it: scheduling, the runner's inputs, the attention metadata, the sampler and the
update. On a GPU that work runs while the device waits, once per step, whatever the model.

    python tools/bench_host_step.py 64 [prof]
"""

from __future__ import annotations

import collections
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
torch.set_num_threads(1)
from engine.bench import seat_decoding  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402

batch = int(sys.argv[1]); context = 600; steps = 40
p = Path(tempfile.mkdtemp()) / "tiny"
import transformers  # noqa: E402
config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                  vocab_size=1024, max_position_embeddings=4096, tie_word_embeddings=True)
torch.manual_seed(0)
transformers.LlamaForCausalLM(config).save_pretrained(p)
blocks = batch * (-(-(context + steps + 16) // 16)) + 16
engine = LLMEngine(p, EngineConfig(device="cpu", dtype="float32", num_kv_blocks=blocks, max_num_seqs=batch, max_num_batched_tokens=max(2048, batch), max_model_len=context + steps + 64))
seat_decoding(engine, batch, context, steps + 16)
acc = collections.defaultdict(float)
def timed(obj, name, label):
    fn = getattr(obj, name)
    def wrap(*a, **k):
        t = time.perf_counter(); r = fn(*a, **k); acc[label] += time.perf_counter() - t; return r
    setattr(obj, name, wrap)
timed(engine.scheduler, "schedule", "schedule")
timed(engine.scheduler, "update", "update")
timed(engine.runner, "prepare", "prepare")
timed(engine.runner.attention, "build", "attn build")
timed(engine.runner.model, "run_stage", "model")
timed(engine.sampler, "sample", "sample")
for _ in range(3): engine.step()
acc.clear()
t = time.perf_counter()
for _ in range(steps): engine.step()
total = (time.perf_counter() - t) / steps * 1e3
print(f"batch {batch}: step {total:.3f} ms;", ", ".join(f"{k} {v / steps * 1e3:.3f}" for k, v in acc.items()), f"; other {total - sum(acc.values()) / steps * 1e3:.3f}")
if "prof" in sys.argv:
    import cProfile, pstats
    pr = cProfile.Profile(); pr.enable()
    for _ in range(10): engine.step()
    pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(40)
