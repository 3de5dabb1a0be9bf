#!/bin/sh
# Builds llama.cpp's llama-bench, llama-completion and llama-simple as a *benchmark-only peer* (never a pagedserve
# dependency). Source: the llama.cpp vendored in the llama-cpp-python 0.3.36 sdist (so the same llama.cpp
# as benchmarks/peers/llama_cpp_w2.py). Idempotent: re-running only rebuilds what is missing.
# Output: benchmarks/peers/llama_cpp/build/bin/{llama-bench,llama-completion,llama-simple,llama-batched-bench,
# llama-quantize} (gitignored). ARCH=x86-64-v3: built without AVX-512 (AVX2, FMA, F16C, BMI2: the older EPYCs'
# instruction sets, for benchmarks/compare.sh's emulation of them) into build_avx2/ instead.
# (In this llama.cpp, llama-cli is the chat UI built on the server, so the non-interactive one-shot tool is
# llama-completion; the server is not built.)
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
VERSION=0.3.36
DL="$HERE/dl"
SRC="$HERE/src/llama_cpp_python-$VERSION"
BUILD="$HERE/build"
CPUFLAGS="-DGGML_NATIVE=ON"
if [ -n "${ARCH:-}" ]; then
    [ "$ARCH" = x86-64-v3 ] || { echo "ARCH: only x86-64-v3, got $ARCH" >&2; exit 2; }
    BUILD="$HERE/build_avx2"
    CPUFLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF"
fi
ROOT=$(cd "$HERE/../../.." && pwd)
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3

if [ ! -d "$SRC/vendor/llama.cpp" ]; then
    mkdir -p "$DL" "$HERE/src"
    if ! ls "$DL"/llama_cpp_python-$VERSION.tar.gz >/dev/null 2>&1; then
        "$PY" -m pip download -q --no-deps --no-binary :all: -d "$DL" "llama-cpp-python==$VERSION"
    fi
    tar -xzf "$DL/llama_cpp_python-$VERSION.tar.gz" -C "$HERE/src"
fi

CMAKE=cmake
if ! command -v cmake >/dev/null 2>&1; then
    # No system cmake: a private venv just for the build tool (gitignored).
    [ -x "$HERE/../cmake-venv/bin/cmake" ] || { python3 -m venv "$HERE/../cmake-venv" && "$HERE/../cmake-venv/bin/pip" install -q cmake; }
    CMAKE="$HERE/../cmake-venv/bin/cmake"
fi

# GGML_NATIVE builds for this CPU: a build made on another CPU (these machines change) starts afresh.
STAMP=$(grep -m1 '^flags' /proc/cpuinfo | md5sum | cut -c1-16)
if [ -f "$BUILD/CMakeCache.txt" ] && [ "$(cat "$BUILD/cpu-stamp" 2>/dev/null)" != "$STAMP" ]; then
    rm -rf "$BUILD"
fi
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
    # shellcheck disable=SC2086
    "$CMAKE" -S "$SRC/vendor/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release $CPUFLAGS \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF
fi
"$CMAKE" --build "$BUILD" -j"${JOBS:-2}" --target llama-bench llama-completion llama-simple llama-batched-bench \
    llama-quantize
echo "$STAMP" > "$BUILD/cpu-stamp"
ls -l "$BUILD/bin"
