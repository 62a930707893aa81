#!/usr/bin/env bash
# The GPU kit (docs/gpu.md): on a lent GPU machine (no package index; torch, Triton and CUDA
# already installed), one command installs kvtier offline from the carried wheelhouse and
# proves and measures every CUDA path in under 9 minutes:
#
#   bash scripts/gpu_wheels.sh              # here, with the package index: builds .gpu-wheels/
#   bash scripts/gpu_check.sh               # there, with .gpu-wheels/ carried beside the tree
#   bash scripts/gpu_check.sh --dry-run     # anywhere: the same steps on the CPU, toy sizes
#
# Results go to $OUT (the device tool's folder) or --out DIR (default out/gpu-kit), and on a
# GPU also to benchmarks/results/, named by the GPU. Options: --out DIR, --work DIR (scratch:
# the 16 GB checkpoint, the disk tier; default out/gpu-kit-work), --budget-s S (default 540),
# --steps a,b (only these of cuda-tests,host-transfer,kernels,ttft: a rerun on the same loan).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
dry=0
out=${OUT:-out/gpu-kit}
budget=540
work=out/gpu-kit-work
steps=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --out) out=$2; shift ;;
    --budget-s) budget=$2; shift ;;
    --work) work=$2; shift ;;
    --steps) steps=(--steps "$2"); shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$out"

if [ "$dry" = 1 ]; then
  # The test environment (CI passes its own interpreter); set it up where it is missing.
  py=${KVTIER_PYTHON:-.venv/bin/python}
  if [ ! -x "$py" ] && [ -z "${KVTIER_PYTHON:-}" ]; then bash scripts/setup.sh; fi
  exec "$py" -m kvtier.cli bench gpu-kit --dry-run --out "$out" --work "$work" \
    --budget-s "$budget" "${steps[@]}"
fi

wheels=${KVTIER_GPU_WHEELS:-.gpu-wheels}
if [ ! -d "$wheels" ]; then
  echo "gpu_check.sh: no $wheels/ here: run 'bash scripts/gpu_wheels.sh' on a machine with" \
       "the package index and carry .gpu-wheels with the working tree (docs/gpu.md)" >&2
  exit 2
fi
host_py=${KVTIER_GPU_PYTHON:-python3}
venv=.venv-gpu
log="$work/install.log"  # $OUT returns at most eight files: the results and kit.log
mkdir -p "$work"
install() {
  set -e
  if [ ! -x "$venv/bin/python" ]; then
    "$host_py" -m venv --system-site-packages "$venv" \
      || "$host_py" -m venv --system-site-packages --without-pip "$venv"
  fi
  # The host interpreter may itself be a venv (its torch is in its own site-packages, which
  # --system-site-packages does not reach): name its folders in a .pth file.
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$host_py" -c 'import site; print("\n".join(site.getsitepackages()))' > "$site/_kvtier_host_site.pth"
  if "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
    pip=("$venv/bin/python" -m pip)
  else
    pip=("$host_py" -m pip --python "$venv/bin/python")
  fi
  "${pip[@]}" install -q --no-index --find-links "$wheels" "setuptools>=77" wheel
  "${pip[@]}" install -q --no-index --find-links "$wheels" --no-build-isolation -e .
  "$venv/bin/python" - <<'PY'
import torch, triton
import kvtier.gpu_pool.kernels.host_native as native
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"GPU: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}, "
      f"native host kernels: {native.AVAILABLE}")
assert torch.cuda.is_available(), "torch sees no CUDA device"
PY
}
echo "[gpu-kit] installing kvtier offline into $venv (log: $log)"
if ! (install) >"$log" 2>&1; then
  tail -n 40 "$log" >&2
  echo "gpu_check.sh: the offline install failed (whole log: $log)" >&2
  exit 1
fi
tail -n 1 "$log"
echo "[gpu-kit] installed in $((SECONDS - start)) s"
if ! command -v redis-server >/dev/null && [ -x "$wheels/redis/redis-server" ]; then
  export PATH="$PWD/$wheels/redis:$PATH"  # the bundled server (scripts/gpu_wheels.py)
fi
left=$((budget - (SECONDS - start)))
exec "$venv/bin/python" -m kvtier.cli bench gpu-kit --out "$out" --work "$work" --budget-s "$left" \
  --results-dir benchmarks/results "${steps[@]}"
