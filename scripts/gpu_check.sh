#!/usr/bin/env bash
# GPU checks in ONE device call (see /work/shared/device/README.md):
#   installs the PyCUDA wheels into /tmp/site, prints `nvidia-smi -L`, runs the GPU tests
#   (`pytest -m gpu`), the kernel benchmark (which measures the copy bandwidth first) and the
#   end-to-end benchmark if present, then prints a short table LAST. Everything lands under $OUT.
#
# Once, on the machine that holds the repository (copies the wheels, and the source archive for the
# fallback build, into the git-ignored .whl/):
#   bash scripts/gpu_check.sh --prepare
# Then, with the device tool (about 5 minutes of device time; bench/e2e.py is capped at 2):
#   run(command="COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_check.sh", carry=[".whl"],
#       timeout_s=420)        (expand the commit here before the call: the device may lack .git)
# and commit the printed table (it is also in $OUT/table.md) under bench/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

if [[ "${1:-}" == "--prepare" ]]; then
    mkdir -p .whl
    cp -f /work/shared/device/wheels/*.whl .whl/
    cp -f /work/shared/device/pycuda-2026.1.tar.gz .whl/ 2>/dev/null || true
    ls -la .whl
    exit 0
fi

OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }

# ---- 1. PyCUDA from the carried wheels (fallback: build the wheel from the carried archive)
stamp "installing wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$ROOT:${PYTHONPATH:-}
if ! python3 -c "import pycuda.driver" 2>"$OUT/pycuda_import.txt"; then
    cat "$OUT/pycuda_import.txt"
    if [[ -f .whl/pycuda-2026.1.tar.gz ]]; then
        stamp "the pycuda wheel does not import here: building it from the archive (~2.5 min)"
        echo "CUDA_ENABLE_CURAND = False" > ~/.aksetup-defaults.py
        mkdir -p /tmp/pycuda-wheel
        python3 -m pip wheel -q --no-index --no-build-isolation --no-deps -w /tmp/pycuda-wheel \
            .whl/pycuda-2026.1.tar.gz && cp /tmp/pycuda-wheel/*.whl "$OUT/" &&
            python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \
                --target /tmp/site /tmp/pycuda-wheel/*.whl
    fi
    python3 -c "import pycuda.driver" || { stamp "FATAL: pycuda does not import"; exit 2; }
fi
export PYCUDA_CACHE_DIR=/tmp/pycuda-cache
mkdir -p "$PYCUDA_CACHE_DIR"

# ---- 2. the machine
stamp "device"
nvidia-smi -L | tee "$OUT/nvidia-smi.txt"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
# The device gets a copy of the working tree, maybe without .git: pass COMMIT=... in the command.
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
DIRTY=$(git status --porcelain 2>/dev/null | grep -q . && echo "+dirty" || true)
python3 -c "import torch, pycuda; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'pycuda', pycuda.VERSION_TEXT, 'device', torch.cuda.get_device_name(0))"

# ---- 3. GPU tests (compile the module once first, so a compile error is shown on its own)
stamp "compiling the kernels with PyCUDA"
python3 - <<'EOF' 2>&1 | tee "$OUT/compile.txt"
import time, torch
t = time.time()
from worker.kernels.pycuda_backend import PyCudaBackend
b = PyCudaBackend("cuda")
print(f"PyCudaBackend ready: arch {b.arch}, {b.num_sms} SMs, {len(b._fns)} kernels, "
      f"{time.time() - t:.1f} s")
EOF
stamp "pytest -m gpu"
python3 -m pytest -q -m gpu tests/ -p no:cacheprovider -rs --continue-on-collection-errors \
    --junitxml="$OUT/pytest_gpu.xml" \
    2>&1 | tee "$OUT/pytest_gpu.txt"
TEST_RC=${PIPESTATUS[0]}
TEST_SUMMARY=$(tail -1 "$OUT/pytest_gpu.txt")

# ---- 4. benchmarks
stamp "bench/kernels.py"
python3 bench/kernels.py --json "$OUT/bench_kernels.json" 2>&1 | tee "$OUT/bench_kernels.txt"
BENCH_RC=${PIPESTATUS[0]}
if [[ -f bench/e2e.py ]]; then
    stamp "bench/e2e.py"
    timeout 120 python3 bench/e2e.py 2>&1 | tee "$OUT/bench_e2e.txt" || true
fi

# ---- 5. the short table, last
{
    echo "# GPU check $(date -u +%Y-%m-%dT%H:%MZ), $GPU, commit $COMMIT$DIRTY"
    echo
    echo "pytest -m gpu (rc $TEST_RC): $TEST_SUMMARY"
    echo "bench/kernels.py rc $BENCH_RC"
    echo
    sed -n '/^## decode attention/,$p' "$OUT/bench_kernels.txt"
} > "$OUT/table.md"
stamp "done"
echo
cat "$OUT/table.md"
[[ $TEST_RC -eq 0 && $BENCH_RC -eq 0 ]]
