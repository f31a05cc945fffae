#!/usr/bin/env bash
# Build (or reuse) the separate venv in which a real SGLang 0.5.23 runs on this machine's CPU, and
# install the current checkout into it. Usage: scripts/setup_sglang_cpu.sh
#
# The venv lives outside the checkout (default ~/.cache/moespec/sglang-venv, override with
# MOESPEC_SGLANG_VENV) so that fresh CI clones on the same machine reuse its ~6 GB instead of
# downloading them again. A marker file written as the last step says the heavy part is complete;
# an interrupted build has no marker and is resumed (pip skips what is already there).
#
# The recipe (see ../shared/sglang-cpu-notes.md): sglang pins torch 2.14.1 and a dozen CUDA-only
# packages, none of which the CPU paths import, so sglang goes in with --no-deps and its pure-Python
# runtime deps are listed here by hand. The CPU torch 2.13.0 wheel cannot be used: sglang imports
# torchvision at start-up and the registry's torchvision wheels are CUDA-linked.
set -euo pipefail
cd "$(dirname "$0")/.."
checkout="$(pwd)"
venv="${MOESPEC_SGLANG_VENV:-$HOME/.cache/moespec/sglang-venv}"
# Bump when the recipe below changes: a venv built from an older recipe is completed again.
recipe="sglang-0.5.23-cpu-recipe-1"
marker="$venv/.moespec-sglang-complete"
start=$SECONDS

mkdir -p "$(dirname "$venv")"
# Two CI runs on one machine must not build the same venv at once.
exec 9>"$venv.lock"
flock 9

if [ -f "$marker" ] && [ "$(cat "$marker")" = "$recipe" ]; then
  echo "sglang venv: reusing $venv"
else
  echo "sglang venv: building $venv ($recipe)"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q torch==2.14.1 torchvision==0.29.1
  "$venv/bin/python" -m pip install -q --no-deps sglang==0.5.23
  "$venv/bin/python" -m pip install -q \
    aiohttp fastapi uvicorn uvloop pyzmq msgspec orjson pybase64 partial_json_parser \
    xgrammar==0.2.7 llguidance outlines==0.1.11 transformers==5.19.0 tokenizers==0.23.2 \
    sentencepiece tiktoken compressed-tensors==0.18.0 gguf einops interegular openai==2.8.0 \
    openai-harmony==0.0.4 anthropic blobfile==3.0.0 setproctitle psutil prometheus-client \
    python-multipart watchfiles xxhash zstandard nvidia-ml-py triton pillow scipy easydict distro \
    regex requests pydantic \
    IPython dill soundfile
  echo "$recipe" > "$marker"
fi

# The checkout that runs is this one (editable, so a fresh clone elsewhere points the venv at
# itself); its own dependencies and the test extras are resolved against what is already there.
"$venv/bin/python" -m pip install -q -e "$checkout[test]"
"$venv/bin/python" -c "import sglang, torch, service; print('sglang', sglang.__version__, 'torch', torch.__version__)"

echo "sglang venv: $venv"
echo "sglang venv: wall time $((SECONDS - start)) s, size $(du -sh "$venv" | cut -f1)"
