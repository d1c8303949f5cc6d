#!/usr/bin/env bash
# Every GPU check in ONE device call, each stage under its own timeout, and a table LAST.
#
#   bash scripts/gpu_check.sh --prepare   here, once: wheels into the git-ignored .whl/ (PyCUDA and
#                                         its pure-Python needs; .whl/e2e: grpcio, protobuf,
#                                         grpcio-health-checking, grpcio-reflection for the e2e stage)
#   bash scripts/gpu_check.sh --dry-run   here: the whole logic on the CPU; only what needs CUDA is
#                                         replaced (said so in the table). tests/test_gpu_check.py
#   bash scripts/gpu_check.sh             on the device, through the device tool, from the
#                                         checkout the session started in (the one the tool sends):
#     run(command="COMMIT=<sha> bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=450)
#   (expand <sha> here: the device gets no .git), then commit $OUT/table.md under bench/results/.
#   Expected ~5 minutes on an H200 (estimate; the budget stops it at 7); the dry run takes ~1 minute.
#
# Stages (the table gives each one's status, seconds and a summary line):
#   wheels    PyCUDA into /tmp/site (fallback: build its wheel from the carried archive, ~2.5 min);
#             the e2e wheels into /tmp/site-e2e, used by the e2e stage only
#   device    nvidia-smi -L; torch, PyCUDA, grpcio and protobuf versions (device's and e2e's)
#   compile   PyCudaBackend once (PyCUDA's nvcc, kept in PYCUDA_CACHE_DIR); if it fails, the stages
#             that need the module are skipped instead of compiling again in each
#   tests     pytest -m gpu on the GPU test modules only (the others import packages the device
#             lacks); fails if nothing passed
#   racecheck compute-sanitizer over worker.kernels.selfcheck (every kernel family, small sizes):
#   memcheck  the one race and memory check that the CPU emulation cannot give (~60 s together)
#   bench     bench/kernels.py: copy bandwidth, decode, prefill and cache write vs SDPA, registers
#   e2e       two pipeline stages on the GPU at --kv-memory-fraction 0.45 next to a process holding
#             45% of it (another stage's cache), a worker restarted, generation before and after
#   e2e-06b   one worker on the real Qwen3-0.6B shape (random weights written on the device, as
#             Qwen3 ships them: bfloat16 safetensors; --dtype auto = bfloat16 there), both bench
#             workloads (16 prompts of 64-512 ids / 32 new, 16 of 16-64 / 64 new): tok/s, start-up,
#             load time; the dry run uses a 2-layer, 4,096-vocab cut of the shape on the CPU
# GPU_CHECK_BUDGET_S (default 540) bounds the whole run: a stage gets min(its timeout, time left),
# so the table always comes out. GPU_CHECK_FAIL=<stage> makes that stage fail (tests the logic).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
MODE=real
case "${1:-}" in
    --prepare) MODE=prepare ;;
    --dry-run) MODE=dry ;;
    "") ;;
    *) echo "usage: $0 [--prepare | --dry-run]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
export PATH=/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1

if [[ $MODE == prepare ]]; then
    mkdir -p .whl/e2e
    cp -f ../shared/device/wheels/*.whl .whl/ 2>/dev/null || cp -f /work/shared/device/wheels/*.whl .whl/
    cp -f ../shared/device/pycuda-2026.1.tar.gz .whl/ 2>/dev/null ||
        cp -f /work/shared/device/pycuda-2026.1.tar.gz .whl/ 2>/dev/null || true
    # the versions this checkout is tested with (protobuf >= the one that generated minipaged/v1)
    pins=$("$PY" -c "from importlib.metadata import version as v
print(' '.join(f'{d}=={v(d)}' for d in ('grpcio', 'protobuf', 'grpcio-health-checking', 'grpcio-reflection')))")
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl/e2e $pins || exit 1
    ls -la .whl .whl/e2e
    exit 0
fi

OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
LOG=$OUT/gpu_check.log
: > "$LOG"
T0=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-540}
DEADLINE=$(( T0 + BUDGET ))
RESERVE_S=15            # for the table
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
declare -A STATUS SECS NOTE
ORDER=()

# run_stage NAME TIMEOUT_S SUMMARY_REGEX CMD...: CMD under `timeout`, output to the log; records
# ok / FAIL (rc) / TIMEOUT, the seconds, and the last output line matching SUMMARY_REGEX.
run_stage() {
    local name=$1 limit=$2 pattern=$3 rc t
    shift 3
    ORDER+=("$name")
    local left=$(( DEADLINE - $(date +%s) - RESERVE_S ))
    if (( left < 10 )); then
        STATUS[$name]=skipped SECS[$name]=0 NOTE[$name]="out of time (GPU_CHECK_BUDGET_S=$BUDGET)"
        return 1
    fi
    (( limit > left )) && limit=$left
    stamp "== $name (timeout ${limit}s)"
    t=$(date +%s)
    if [[ "${GPU_CHECK_FAIL:-}" == "$name" ]]; then
        echo "GPU_CHECK_FAIL=$name: injected failure" | tee "$WORK/$name.txt"
        rc=1
    else
        timeout -k 10 "$limit" "$@" 2>&1 | tee "$WORK/$name.txt"
        rc=${PIPESTATUS[0]}
    fi
    cat "$WORK/$name.txt" >> "$LOG"
    SECS[$name]=$(( $(date +%s) - t ))
    NOTE[$name]=$(grep -E "$pattern" "$WORK/$name.txt" | tail -1)
    [[ -n ${NOTE[$name]} ]] || NOTE[$name]=$(grep -v '^[[:space:]]*$' "$WORK/$name.txt" | tail -1)
    NOTE[$name]=$(sed -E 's/^(SUMMARY: |## )//; s/\|/\//g' <<< "${NOTE[$name]}" | cut -c1-160)
    if (( rc == 0 )); then STATUS[$name]=ok
    elif (( rc == 124 || rc == 137 )); then STATUS[$name]=TIMEOUT; NOTE[$name]="killed after ${limit}s ${NOTE[$name]}"
    else STATUS[$name]="FAIL (rc $rc)"; fi
    return "$rc"
}
skip_stage() { ORDER+=("$1"); STATUS[$1]=skipped SECS[$1]=0 NOTE[$1]=$2; }

# ------------------------------------------------------------------ the Python the stages run
cat > "$WORK/versions.py" <<'EOF'
import importlib, platform, re, sys
from importlib.metadata import version, PackageNotFoundError
def ver(dist):
    try:
        return version(dist)
    except PackageNotFoundError:
        return "absent"
def imports(mod):
    try:
        importlib.import_module(mod)
        return "imports"
    except Exception as e:
        return f"does not import ({type(e).__name__}: {str(e)[:80]})"
import torch
print(f"python {platform.python_version()} at {sys.executable}; torch {torch.__version__} "
      f"(cuda {torch.version.cuda}, available {torch.cuda.is_available()})")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device {p.name}: {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")
for d in ("pycuda", "transformers", "pytest", "pytest-timeout", "grpcio", "protobuf",
          "grpcio-health-checking", "grpcio-reflection"):
    print(f"  {d:24s} {ver(d)}")
gen = re.search(r"Protobuf Python Version: ([\d.]+)", open("minipaged/v1/worker_pb2.py").read()).group(1)
mods = {m: imports(m) for m in ("pycuda.driver", "grpc_health.v1.health", "minipaged.v1.worker_pb2_grpc")}
for m, s in mods.items():
    print(f"  {m:32s} {s}")
print(f"SUMMARY: {sys.argv[1]}: grpcio {ver('grpcio')}, protobuf {ver('protobuf')} (gencode {gen}), "
      f"generated code {'imports' if mods['minipaged.v1.worker_pb2_grpc'] == 'imports' else 'FAILS'}, "
      f"health {'ok' if mods['grpc_health.v1.health'] == 'imports' else 'absent'}, pycuda {ver('pycuda')}")
EOF
cat > "$WORK/compile.py" <<'EOF'
import sys, time
t = time.time()
if sys.argv[1] == "dry":
    from worker.kernels import emulated, source
    path = emulated.build_library()
    print(f"SUMMARY: dry run (PyCUDA needs CUDA): the same {len(source.kernel_signatures())} kernels "
          f"built for the emulation in {time.time() - t:.1f} s")
else:
    from worker.kernels.pycuda_backend import PyCudaBackend
    b = PyCudaBackend("cuda")
    print(f"SUMMARY: PyCudaBackend: arch {b.arch}, {b.num_sms} SMs, {len(b._calls)} kernels, "
          f"{time.time() - t:.1f} s")
EOF
cat > "$WORK/e2e.py" <<'EOF'
"""Two pipeline stages at --kv-memory-fraction 0.45 next to a process holding 45% of the GPU (as
another stage's full cache would), a restart of stage 0, generation before and after."""
import sys, time
import torch
from client import LocalCluster
dry = sys.argv[1] == "dry"
device = "cpu" if dry else "cuda"
if not dry:
    free, total = torch.cuda.mem_get_info()
    ballast = torch.empty(int(0.45 * total), dtype=torch.uint8, device="cuda")
    print(f"this process holds {ballast.numel() / 2**30:.1f} GiB of {total / 2**30:.0f} GiB "
          f"(the old budget rule would give each worker <= 0 and exit 2)")
prompts = [[(7 * i + 3 * j) % 256 for j in range(20 + 9 * i)] for i in range(8)]
reqs = [{"prompt_token_ids": p, "max_new_tokens": 16, "ignore_eos": True} for p in prompts]
with LocalCluster(model="tiny", workers=2, device=device, dtype="float32" if dry else "bfloat16",
                  extra_worker_args=["--kv-memory-fraction", "0.45"],
                  extra_service_args=["--num-blocks", "1024"], startup_timeout=90) as c:
    t = time.time()
    first = c.client.wait(c.client.submit(reqs))
    dt = time.time() - t
    n = sum(len(r.token_ids) for r in first)
    print(f"{len(first)} requests, {n} tokens in {dt:.2f} s ({n / dt:.0f} tok/s incl. prefill)")
    c.restart_worker(0)
    again = c.client.wait(c.client.submit(reqs))
    same = [r.token_ids for r in again] == [r.token_ids for r in first]
    st = c.client.stats()
    for line in c.logs(400).splitlines():
        if "K/V budget" in line:
            print("  " + line.split(": ", 1)[-1])
    ok = n == 8 * 16 and sum(len(r.token_ids) for r in again) == n and st.invariants_ok
    print(f"SUMMARY: {device}: 2 stages at 0.45, {n / dt:.0f} tok/s; worker 0 restarted and served "
          f"again (tokens {'identical' if same else 'DIFFERENT'}), invariants_ok {st.invariants_ok}")
sys.exit(0 if ok else 1)
EOF
cat > "$WORK/e2e_06b.py" <<'EOF'
"""The Qwen3-0.6B shape end to end (issue 18): random bfloat16 weights written with torch alone (no
transformers on the device) as one safetensors file, one worker, --dtype auto, both workloads."""
import json, os, random, struct, sys, time
import torch
from client import LocalCluster
dry = sys.argv[1] == "dry"
cfg = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
           intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
           head_dim=128, tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=40960,
           rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False, torch_dtype="bfloat16",
           bos_token_id=151643, eos_token_id=151645)
if dry:  # the same code on the CPU at a size the dry run can afford
    cfg.update(num_hidden_layers=2, vocab_size=4096)
d = f"/tmp/qwen3-0.6b-shape{'-dry' if dry else ''}"
if not os.path.isfile(os.path.join(d, "config.json")):
    H, L, I, V, D = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"], 128
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (16 * D, H), p + "self_attn.k_proj.weight": (8 * D, H),
                       p + "self_attn.v_proj.weight": (8 * D, H), p + "self_attn.o_proj.weight": (H, 16 * D),
                       p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
                       p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                       p + "mlp.down_proj.weight": (H, I), p + "input_layernorm.weight": (H,),
                       p + "post_attention_layernorm.weight": (H,)})
    gen = torch.Generator().manual_seed(0)
    header, off = {}, 0
    for name, shape in shapes.items():
        n = 2 * torch.Size(shape).numel()
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    os.makedirs(d + ".partial", exist_ok=True)
    with open(os.path.join(d + ".partial", "model.safetensors"), "wb") as f:
        h = json.dumps(header).encode()
        h += b" " * (-len(h) % 8)
        f.write(struct.pack("<Q", len(h)) + h)
        for name, shape in shapes.items():
            t = (torch.ones(shape) if name.endswith("norm.weight")
                 else torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
            f.write(t.view(torch.uint8).numpy().tobytes())
    with open(os.path.join(d + ".partial", "config.json"), "w") as f:
        json.dump(cfg, f)
    os.replace(d + ".partial", d)
rng = random.Random(0)
loads = {"prefill": [(rng.randint(64, 512), 32) for _ in range(16)],
         "decode": [(rng.randint(16, 64), 64) for _ in range(16)]}
if dry:
    loads = {k: [(n // 8, 4) for n, _ in v[:4]] for k, v in loads.items()}
t0 = time.time()
with LocalCluster(model=d, workers=1, device="cpu" if dry else "cuda", dtype=None, startup_timeout=240,
                  extra_service_args=["--num-blocks", "4096"]) as c:
    startup = time.time() - t0
    c.client.wait(c.client.submit([{"prompt_token_ids": [1, 2, 3, 4], "max_new_tokens": 2}]))  # warm-up
    out = []
    for name, spec in loads.items():
        reqs = [{"prompt_token_ids": [rng.randrange(cfg["vocab_size"]) for _ in range(n)], "max_new_tokens": m,
                 "ignore_eos": True} for n, m in spec]
        t = time.time()
        res = c.client.wait(c.client.submit(reqs))
        dt = time.time() - t
        n_tok = sum(len(r.token_ids) for r in res)
        assert n_tok == sum(m for _, m in spec), (name, n_tok)
        out.append(f"{name} {n_tok / dt:.0f} tok/s")
    logs = c.logs(400)
    st = c.client.stats()
loaded = [line.split("ready: ", 1)[-1] for line in logs.splitlines() if "weights in" in line]
dtype = loaded[-1].split(" of ", 1)[-1].split(" ", 1)[0] if loaded else "?"
print(f"load: {loaded[-1] if loaded else '?'}")
print(f"SUMMARY: {'dry, 2-layer cut of ' if dry else ''}qwen3-0.6b shape, dtype auto = {dtype}: "
      f"{', '.join(out)}; start-up {startup:.0f} s; invariants_ok {st.invariants_ok}")
sys.exit(0 if st.invariants_ok else 1)
EOF

# ------------------------------------------------------------------ 1. wheels
SITE=/tmp/site SITE_E2E=/tmp/site-e2e
if [[ $MODE == dry ]]; then
    mkdir -p "$WORK/shim/grpc_health" "$WORK/shim/grpc_reflection"    # the device lacks these two
    for m in grpc_health grpc_reflection; do
        echo "raise ImportError('$m: absent on the device (gpu_check --dry-run hides it)')" \
            > "$WORK/shim/$m/__init__.py"
    done
    run_stage wheels 30 SUMMARY bash -c 'echo "SUMMARY: dry run (cp312 wheels for the device):" \
        "$(ls .whl/*.whl 2>/dev/null | wc -l) in .whl, $(ls .whl/e2e/*.whl 2>/dev/null | wc -l) in .whl/e2e"'
    DEV_PATH=$WORK/shim:$ROOT E2E_PATH=$ROOT
else
    run_stage wheels 60 SUMMARY bash -c "
        $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target $SITE .whl/*.whl &&
        { [[ ! -d .whl/e2e ]] || $PY -m pip install -q --no-index --no-deps --no-compile --upgrade \
              --target $SITE_E2E .whl/e2e/*.whl; } &&
        PYTHONPATH=$SITE $PY -c 'import pycuda.driver' &&
        echo \"SUMMARY: pycuda imports, \$(ls .whl/e2e/*.whl 2>/dev/null | wc -l) e2e wheels\""
    if [[ ${STATUS[wheels]} != ok && -f .whl/pycuda-2026.1.tar.gz ]]; then
        echo "CUDA_ENABLE_CURAND = False" > ~/.aksetup-defaults.py
        run_stage pycuda-build 240 SUMMARY bash -c "
            $PY -m pip wheel -q --no-index --no-build-isolation --no-deps -w $WORK/wheel \
                .whl/pycuda-2026.1.tar.gz && cp $WORK/wheel/*.whl $OUT/ &&
            $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target $SITE \
                $WORK/wheel/*.whl && PYTHONPATH=$SITE $PY -c 'import pycuda.driver' &&
            echo \"SUMMARY: built, installed and imports (the wheel is in OUT for next time)\"" &&
            STATUS[wheels]=ok NOTE[wheels]="the carried pycuda wheel did not import: rebuilt (pycuda-build)"
    fi
    DEV_PATH=$SITE:$ROOT E2E_PATH=$SITE_E2E:$SITE:$ROOT
fi
export PYCUDA_CACHE_DIR=/tmp/pycuda-cache
mkdir -p "$PYCUDA_CACHE_DIR"

# ------------------------------------------------------------------ 2. device and versions
if [[ $MODE == real ]]; then
    nvidia-smi -L 2>&1 | tee -a "$LOG"
    GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
    GPU=${GPU:-"GPU unknown (nvidia-smi failed)"}
else
    GPU="no GPU (dry run on $(nproc) CPU cores)"
fi
PYTHONPATH=$DEV_PATH run_stage device 60 SUMMARY "$PY" "$WORK/versions.py" "device env"
PYTHONPATH=$E2E_PATH run_stage versions-e2e 60 SUMMARY "$PY" "$WORK/versions.py" "e2e env"
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
DIRTY=$(git status --porcelain --untracked-files=no 2>/dev/null | grep -q . && echo "+dirty" || true)

# ------------------------------------------------------------------ 3. compile once
export PYTHONPATH=$DEV_PATH
run_stage compile 180 SUMMARY "$PY" "$WORK/compile.py" "$MODE" && COMPILED=1 || COMPILED=0
NO_MODULE="skipped: no compiled module (compile: ${STATUS[compile]})"

# ------------------------------------------------------------------ 4. GPU tests
HAS_TIMEOUT=$("$PY" -c "import pytest_timeout" 2>/dev/null && echo 1 || echo 0)
if (( COMPILED )); then
    run_stage tests 200 "passed|skipped|failed|error" "$PY" -m pytest -q -m gpu -p no:cacheprovider \
        -rs tests/test_kernels_gpu.py tests/test_model_gpu.py --junitxml="$OUT/pytest_gpu.xml" \
        $( (( HAS_TIMEOUT )) && echo --timeout 120 )
    read -r T_TOTAL T_PASS T_FAIL T_ERR T_SKIP < <("$PY" -c "
import sys, xml.etree.ElementTree as ET
try:
    r = ET.parse(sys.argv[1]).getroot(); s = r if r.tag == 'testsuite' else r.find('testsuite')
    n, f, e, k = (int(s.get(a, 0)) for a in ('tests', 'failures', 'errors', 'skipped'))
    print(n, n - f - e - k, f, e, k)
except Exception:
    print(0, 0, 0, 1, 0)" "$OUT/pytest_gpu.xml")
    COUNTS="$T_TOTAL collected: $T_PASS passed, $T_FAIL failed, $T_ERR errors, $T_SKIP skipped"
    [[ ${STATUS[tests]} == TIMEOUT ]] && NOTE[tests]="killed at the timeout; $COUNTS" || NOTE[tests]=$COUNTS
    if [[ $MODE == dry ]]; then        # no CUDA here: all skip; what counts is that all collect
        NOTE[tests]+=" (dry run: no CUDA)"
        (( T_TOTAL > 0 && T_FAIL + T_ERR == 0 )) || STATUS[tests]="FAIL (collection)"
    elif [[ ${STATUS[tests]} == ok ]] && (( T_PASS == 0 )); then
        STATUS[tests]="FAIL (0 passed)"
    fi
else
    skip_stage tests "$NO_MODULE"
fi

# ------------------------------------------------------------------ 5. compute-sanitizer
SAN_OPTS="--error-exitcode 3 --print-limit 20"
if (( ! COMPILED )); then
    skip_stage racecheck "$NO_MODULE"; skip_stage memcheck "$NO_MODULE"
elif [[ $MODE == dry ]]; then    # the same driver, on the emulation under hostile schedules
    run_stage racecheck 60 "^selfcheck" "$PY" -m worker.kernels.selfcheck --backend emulated --quick \
        --schedule random:1
    run_stage memcheck 60 "^selfcheck" "$PY" -m worker.kernels.selfcheck --backend emulated --quick \
        --schedule reverse
    NOTE[racecheck]="dry run (compute-sanitizer needs CUDA): ${NOTE[racecheck]}"
    NOTE[memcheck]="dry run (compute-sanitizer needs CUDA): ${NOTE[memcheck]}"
elif ! command -v compute-sanitizer > /dev/null; then
    skip_stage racecheck "compute-sanitizer not found"; skip_stage memcheck "compute-sanitizer not found"
else
    run_stage racecheck 90 "SUMMARY|^selfcheck|not supported" compute-sanitizer --tool racecheck \
        --kernel-name kns=paged_ $SAN_OPTS "$PY" -m worker.kernels.selfcheck --backend pycuda
    # without torch's caching allocator every tensor is its own allocation: an overrun is seen
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 run_stage memcheck 90 "SUMMARY|^selfcheck|not supported" \
        compute-sanitizer --tool memcheck $SAN_OPTS "$PY" -m worker.kernels.selfcheck --backend pycuda
fi

# ------------------------------------------------------------------ 6. benchmarks
if (( ! COMPILED )); then
    BENCH=(--backends torch)      # the module did not compile: no second try here
else
    BENCH=()
fi
[[ $MODE == dry ]] && BENCH=(--device cpu --smoke --backends torch$( (( COMPILED )) && echo ,emulated))
run_stage bench 180 "spill bytes" "$PY" bench/kernels.py ${BENCH[@]+"${BENCH[@]}"} --json "$OUT/bench_kernels.json"

# ------------------------------------------------------------------ 7. end to end
if (( COMPILED )); then
    PYTHONPATH=$E2E_PATH run_stage e2e 150 SUMMARY "$PY" "$WORK/e2e.py" "$MODE"
    PYTHONPATH=$E2E_PATH run_stage e2e-06b 180 SUMMARY "$PY" "$WORK/e2e_06b.py" "$MODE"
else
    skip_stage e2e "$NO_MODULE"
    skip_stage e2e-06b "$NO_MODULE"
fi

# ------------------------------------------------------------------ 8. the table, last
FAILED=0
{
    echo "# GPU check $(date -u +%Y-%m-%dT%H:%MZ), $GPU, commit $COMMIT$DIRTY$([[ $MODE == dry ]] && echo ', DRY RUN')"
    echo
    echo "| stage | status | s | summary |"
    echo "|---|---|---|---|"
    for s in "${ORDER[@]}"; do
        echo "| $s | ${STATUS[$s]} | ${SECS[$s]} | ${NOTE[$s]} |"
        [[ ${STATUS[$s]} == ok ]] || FAILED=1
    done
    echo
    echo "overall: $( (( FAILED )) && echo FAIL || echo PASS ) in $(( $(date +%s) - T0 )) s"
    echo
    [[ -f $WORK/bench.txt ]] && sed -n '/^## decode attention/,$p' "$WORK/bench.txt"
} > "$OUT/table.md"
stamp "done"
echo
cat "$OUT/table.md" | tee -a "$LOG"
rm -rf "$WORK"
exit $FAILED
