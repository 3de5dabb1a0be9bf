"""RSS of a fresh process after an engine has loaded a model (and generated 8 tokens), as JSON."""

import gc
import json
import sys

from pagedserve.config import EngineConfig
from pagedserve.engine.engine import LLMEngine
from pagedserve.sampling_params import SamplingParams


def status_bytes(field: str) -> int:
    """A /proc/self/status memory field (VmRSS: resident now, VmHWM: the peak) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


model, dtype = sys.argv[1], sys.argv[2]
in_place = "--no-gguf-in-place" not in sys.argv
engine = LLMEngine(EngineConfig(model=model, dtype=dtype, num_kv_blocks=128, max_model_len=2048,
                                gguf_in_place=in_place))
engine.add_request("r", "The capital of France is", SamplingParams(temperature=0, max_tokens=8))
while engine.has_unfinished_requests():
    engine.step()
gc.collect()
kv = sum(t.numel() * t.element_size() for pair in engine.kv_caches for t in pair)
print(json.dumps({"model": model, "dtype": dtype, "gguf_in_place": in_place, "rss_bytes": status_bytes("VmRSS"),
                  "peak_rss_bytes": status_bytes("VmHWM"), "weight_bytes": engine.weight_bytes, "kv_bytes": kv}))
