#!/usr/bin/env bash
# SGLang's own code for tests/engines/test_sglang_hicache_real.py: SGLang 0.5.23 without its CUDA dependencies,
# the CPU torch and this checkout of kvstore (editable) in a venv of their own, `.engines/sglang/` (git-ignored;
# never the project's .venv: SGLang pins transformers and friends its own way).
#
# Idempotent: a stamp file records what was installed (the pins below and a digest of pyproject.toml); a run
# with a matching stamp does nothing. Concurrent runs wait on a lock. Prints the venv's python on success.
#
# Why each step (measured on a 2-vCPU VM, RESULTS.md "SGLang's venv"):
# - sglang==0.5.23 --no-deps: its metadata pins torch==2.14.1 (a CUDA build, GBs of nvidia-* wheels),
#   flashinfer, sgl-kernel and other CUDA-only packages. HiCache's host pools, its controller and the
#   storage factory import none of those; they import the pure-Python packages in DEPS (found by importing
#   them: each one is named by a ModuleNotFoundError of `import sglang.srt.managers.cache_controller`).
# - torch==2.13.0+cpu: the CPU wheel that lies on this machine's disk (the vLLM venv's too); a constraint
#   file keeps every later install from replacing it.
# - triton: SGLang's utils import it at module level (the largest package here: ~1 GB unpacked).
# - torchvision==0.28.0 --no-deps, patched: SGLang's model configs import InternVL's image transforms, and
#   transformers then its video utils. PyPI's torchvision is a CUDA build whose C ops do not load against the
#   CPU torch, and its `_meta_registrations.py` registers fake kernels for two of those ops (nms, qnms)
#   without asking whether they loaded, so `import torchvision` fails. The patch guards those two lines with
#   torchvision's own `extension._has_ops()` (as its other registrations already are): the Python parts
#   import, any C op raises as it would. HiCache never runs an image transform.
# - kvstore editable from this checkout, so SGLang's factory loads the code under test.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${KVSTORE_SGLANG_VENV:-.engines/sglang}
PY=${PYTHON:-python3}
SGLANG_PIN="sglang==0.5.23"
TORCH_PIN="torch==2.13.0+cpu"
TORCH_INDEX="https://download.pytorch.org/whl/cpu"
TORCHVISION_PIN="torchvision==0.28.0"  # the release of torch 2.13
TRANSFORMERS_PIN="transformers==5.19.0"  # what sglang 0.5.23 declares
DEPS=(numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec pydantic pyzmq tqdm ipython
      aiohttp "$TRANSFORMERS_PIN" dill apache-tvm-ffi sentencepiece compressed-tensors gguf)

want="$SGLANG_PIN $TORCH_PIN $TORCHVISION_PIN ${DEPS[*]} kvstore@$(sha256sum pyproject.toml | cut -c1-16)"
stamp="$VENV/.kvstore-sglang-installed"
log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

mkdir -p "$(dirname "$VENV")"
exec 9>"$(dirname "$VENV")/.$(basename "$VENV").lock"
flock -w 1800 9 || { echo "sglang_venv: waited 30 min for another install of $VENV" >&2; exit 1; }

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  echo "$VENV/bin/python"
  exit 0
fi

start=$(date +%s)
log "creating the SGLang venv $VENV ($SGLANG_PIN --no-deps, $TORCH_PIN, kvstore editable)"
rm -f "$stamp"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pins="$VENV/kvstore-constraints.txt"
printf '%s\n' "$TORCH_PIN" "$TRANSFORMERS_PIN" >"$pins"
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" "$TORCH_PIN" 2>/dev/null || "${pip[@]}" "$TORCH_PIN" --extra-index-url "$TORCH_INDEX"
"${pip[@]}" --no-deps "$SGLANG_PIN"
"${pip[@]}" -c "$pins" "${DEPS[@]}"
"${pip[@]}" --no-deps "$TORCHVISION_PIN"
meta=$("$VENV/bin/python" -c "import importlib.util as u; print(u.find_spec('torchvision').submodule_search_locations[0])")/_meta_registrations.py
sed -i -E 's|^@torch\.library\.register_fake\(("torchvision::[a-z_]+")\)$|@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda fn: fn))|' "$meta"
"${pip[@]}" -c "$pins" -e .
# Fail here, not in a test, when SGLang's HiCache and kvstore do not import together.
if ! out=$("$VENV/bin/python" -W ignore -c "
import sglang.srt.managers.cache_controller, sglang.srt.mem_cache.memory_pool, sglang.srt.mem_cache.pool_host.mha
import sglang.srt.mem_cache.storage.backend_factory, sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller
import kvstore.integrations.sglang_hicache" 2>&1); then
  echo "$out" >&2; echo "sglang_venv: SGLang's HiCache and kvstore do not import together in $VENV" >&2; exit 1
fi
echo "$want" >"$stamp"
log "SGLang venv ready in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
echo "$VENV/bin/python"
