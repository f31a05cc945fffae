#!/usr/bin/env bash
# Optional: llama.cpp as a benchmark baseline (`moespec bench llamacpp`).
#
# Everything comes from the package registry: the llama-cpp-python source distribution carries a
# complete llama.cpp (vendor/llama.cpp) with its HF-to-GGUF converter. This script builds the four
# tools the benchmark runs (llama-bench, llama-batched-bench, llama-speculative, llama-server) for this CPU
# (GGML_NATIVE: the instruction set detected at build time) and converts the shipped target and
# dense draft to bf16 GGUF files. Idempotent: a finished step is skipped.
#
#   bash scripts/setup_llama_cpp.sh            # into ~/.cache/moespec/llama.cpp
#   MOESPEC_LLAMA_CPP_DIR=/path bash scripts/setup_llama_cpp.sh
#
# Takes 10-20 minutes on 2 cores (llama-server is most of it); CI does not need it.
set -euo pipefail

VERSION=0.3.36  # llama-cpp-python release whose vendored llama.cpp is built
REPO="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${MOESPEC_LLAMA_CPP_DIR:-$HOME/.cache/moespec/llama.cpp}"
SRC="$DIR/src"
JOBS="${JOBS:-$(nproc)}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$DIR"

if [ ! -f "$SRC/CMakeLists.txt" ]; then
  echo "setup_llama_cpp: fetching llama-cpp-python $VERSION (source) from the package index"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp"
  tar -xzf "$tmp"/llama_cpp_python-"$VERSION".tar.gz -C "$tmp"
  rm -rf "$SRC"
  mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$SRC"
fi

TOOLS=(llama-bench llama-batched-bench llama-speculative llama-server)
if [ ! -x "$SRC/build/bin/llama-speculative" ] || [ ! -x "$SRC/build/bin/llama-server" ]; then
  echo "setup_llama_cpp: building ${TOOLS[*]} (-j$JOBS)"
  cmake -S "$SRC" -B "$SRC/build" -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF \
    -DCMAKE_BUILD_TYPE=Release > "$DIR/cmake.log"
  cmake --build "$SRC/build" -j "$JOBS" --target "${TOOLS[@]}" > "$DIR/build.log"
fi

# The converter's own environment (its pinned transformers differs from the project's).
VENV="$DIR/convert-venv"
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup_llama_cpp: converter environment in $VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet torch==2.13.0
  "$VENV/bin/pip" install --quiet numpy safetensors "transformers==4.57.6" sentencepiece protobuf tqdm pyyaml requests
fi

mkdir -p "$DIR/models"
for model in target draft; do
  out="$DIR/models/$model-bf16.gguf"
  if [ ! -f "$out" ]; then
    echo "setup_llama_cpp: converting service/models/$model -> $out"
    PYTHONPATH="$SRC/gguf-py:$SRC" "$VENV/bin/python" "$REPO/scripts/llama_cpp_convert.py" "$SRC" \
      "$REPO/service/models/$model" --outtype bf16 --outfile "$out" > "$DIR/convert-$model.log" 2>&1 \
      || { tail -20 "$DIR/convert-$model.log" >&2; exit 1; }
  fi
done
echo "setup_llama_cpp: ready in $DIR (moespec bench llamacpp --llama-cpp-dir $DIR)"
