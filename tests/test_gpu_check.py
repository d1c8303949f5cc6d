"""scripts/gpu_check.sh is tested before a GPU exists: `--dry-run` runs its whole logic on this
CPU machine (stages, timeouts, the pytest selection and count, the sanitizer driver, the
benchmark, the two-stage e2e with a restart, the table), replacing only what needs CUDA; and a
failed compile stops every stage that needs the module instead of compiling again in each.
About a minute on 2 cores: the stages start real processes."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from minipaged.config import TINY_CONFIG, ModelConfig
from worker.dtype_choice import resolve_dtype

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")
STAGES = ["wheels", "device", "versions-e2e", "compile", "tests", "racecheck", "memcheck", "bench", "e2e", "e2e-06b"]

pytestmark = pytest.mark.slow


def dry_run(tmp_path, **env):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", SCRIPT, "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                          timeout=400, env={**os.environ, "OUT": str(out), "PYTHON": sys.executable, **env})
    table = (out / "table.md").read_text()
    stages = table.split("\noverall:")[0]
    rows = dict(re.findall(r"^\| ([\w-]+) \| ([^|]+?) \| \d+ \|", stages, re.M))
    secs = dict(re.findall(r"^\| ([\w-]+) \| [^|]+? \| (\d+) \|", stages, re.M))
    return proc, table, rows, secs


def test_dry_run_executes_every_stage(tmp_path):
    proc, table, rows, secs = dry_run(tmp_path)
    print("\n" + table.split("## decode")[0])          # the stage table, with seconds, in -s output
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert list(rows) == STAGES and set(rows.values()) == {"ok"}, table
    assert "overall: PASS" in table and "DRY RUN" in table
    # the GPU modules collect with grpc_health / grpc_reflection hidden, as on the device
    tests = re.search(r"^\| tests \|.*$", table, re.M).group(0)
    assert re.search(r"(\d+) collected: 0 passed, 0 failed, 0 errors, \1 skipped", tests), tests
    assert "health absent" in table and "health ok" in table
    assert "16/16" not in table and "8/8 cases ok" in table      # the quick selfcheck, twice
    assert "tokens identical" in table and "invariants_ok True" in table
    # the real-shape stage; `--dtype auto` on this CPU (worker/dtype_choice.py): bfloat16 where it has
    # bfloat16 instructions (the checkpoint's dtype), else float32 (its bfloat16 weights kept packed)
    auto = resolve_dtype("auto", ModelConfig.from_dict(dict(TINY_CONFIG, dtype="bfloat16"), "bf16"), "cpu")
    assert f"qwen3-0.6b shape, dtype auto = {auto}" in table
    for section in ("## decode attention", "## varlen paged prefill", "## cache write",
                    "## registers and spills"):
        assert section in table
    assert (tmp_path / "out" / "gpu_check.log").stat().st_size > 0
    assert sorted(os.listdir(tmp_path / "out")) == ["bench_kernels.json", "gpu_check.log",
                                                    "pytest_gpu.xml", "table.md"]  # <= 8 files come back


def test_failed_compile_stops_the_stages_that_need_it(tmp_path):
    proc, table, rows, _ = dry_run(tmp_path, GPU_CHECK_FAIL="compile")
    assert proc.returncode == 1
    assert rows["compile"] == "FAIL (rc 1)"
    for stage in ("tests", "racecheck", "memcheck", "e2e"):
        assert rows[stage] == "skipped", table
    assert "skipped: no compiled module (compile: FAIL (rc 1))" in table
    assert rows["bench"] == "ok" and "| emulated us" not in table   # torch and SDPA only
    assert "overall: FAIL" in table
