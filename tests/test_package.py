"""`pip install .` and `pip install -e .` from a clean copy of the tree: the SDK imports from any
directory, and the console scripts start the same programs as `python -m ...`.

The new venvs see this venv's third-party packages through a .pth file and install ours with
--no-deps, so the test needs no network and takes seconds; README/docs time the real thing (a
fresh venv resolving every dependency)."""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig

import pytest

from client.cluster import free_port

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {"minipaged": "client", "minipaged-metadata": "metadata_service", "minipaged-worker": "worker",
           "minipaged-gateway": "gateway"}


def _clean_copy(dest) -> str:
    """What a fresh clone has: tracked files plus new ones git does not ignore."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.splitlines()
    for f in files:
        if os.path.isfile(os.path.join(ROOT, f)):
            os.makedirs(os.path.join(dest, os.path.dirname(f)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), os.path.join(dest, f))
    return str(dest)


def _venv(path) -> str:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    py = os.path.join(path, "bin", "python")
    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]  # this venv's third-party packages (pip, setuptools too)
    with open(os.path.join(purelib, "_deps.pth"), "w") as f:
        f.write(ours + "\n" + "\n".join(site.getsitepackages()) + "\n")
    return py


def _pip_install(py, *args, cwd):
    r = subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                        "--no-build-isolation", *args], cwd=cwd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


def _where(py, cwd) -> str:
    return subprocess.run([py, "-c", "import client, gateway, metadata_service, worker, minipaged.v1; "
                                     "from client import Client, AsyncClient, LocalCluster; print(client.__file__)"],
                          cwd=cwd, check=True, capture_output=True, text=True, env=_env()).stdout.strip()


def _env():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing from the repo
    return env


def test_pip_install_and_console_scripts(tmp_path):
    src = _clean_copy(tmp_path / "src")
    py = _venv(tmp_path / "venv")
    _pip_install(py, ".", cwd=src)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = _where(py, elsewhere)
    assert "site-packages" in where and not where.startswith(ROOT) and not where.startswith(src)
    pkg = os.path.dirname(os.path.dirname(where))
    assert os.path.isfile(os.path.join(pkg, "gateway", "static", "dashboard.html"))
    assert os.path.isfile(os.path.join(pkg, "worker", "kernels", "simt_cpu.h"))
    assert any(f.endswith(".cu") for f in os.listdir(os.path.join(pkg, "worker", "kernels")))
    assert os.path.isfile(os.path.join(pkg, "worker", "cpu_attn_decode.cpp"))  # the CPU kernels' source (issue 21)
    assert not os.path.exists(os.path.join(pkg, "tests"))
    bindir = os.path.dirname(py)
    for script, module in SCRIPTS.items():
        r = subprocess.run([os.path.join(bindir, script), "--help"], cwd=elsewhere, capture_output=True,
                           text=True, env=_env())
        same = subprocess.run([py, "-m", module, "--help"], cwd=elsewhere, capture_output=True, text=True, env=_env())
        assert r.returncode == 0 and same.returncode == 0, r.stderr[-2000:]
        assert r.stdout.startswith(f"usage: {script} ") and same.stdout.startswith(f"usage: python -m {module} ")
        # the same program: everything after the usage block (which wraps by the name's length)
        assert r.stdout.split("\n\n", 1)[1] == same.stdout.split("\n\n", 1)[1]

    # the installed service and CLI talk to each other, started from an unrelated directory
    port = free_port()
    service = subprocess.Popen([os.path.join(bindir, "minipaged-metadata"), "--port", str(port), "--db",
                                str(tmp_path / "jobs.db")], cwd=elsewhere, env=_env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        r = subprocess.run([os.path.join(bindir, "minipaged"), "stats", "--json", "--address", f"127.0.0.1:{port}",
                            "--wait-ready", "0", "--timeout", "30"], cwd=elsewhere, capture_output=True, text=True,
                           env=_env())
        for _ in range(50):
            if r.returncode == 0:
                break
            r = subprocess.run([os.path.join(bindir, "minipaged"), "stats", "--json", "--address",
                                f"127.0.0.1:{port}"], cwd=elsewhere, capture_output=True, text=True, env=_env())
        assert r.returncode == 0, r.stderr
        assert '"ready": false' in r.stdout
        _installed_worker_serves_with_cpu_kernels(tmp_path, bindir, port, pkg, elsewhere)
    finally:
        service.terminate()
        service.wait(30)


def _installed_worker_serves_with_cpu_kernels(tmp_path, bindir, port, pkg, cwd):
    """The installed worker compiles the worker's CPU kernels from site-packages into the user's cache
    (not into site-packages) and serves a request with it."""
    cache = tmp_path / "cache"
    env = {**_env(), "XDG_CACHE_HOME": str(cache)}
    env.pop("MINIPAGED_CPU_KERNEL_DIR", None)
    log_path = tmp_path / "worker.log"
    with open(log_path, "w") as log:
        worker = subprocess.Popen([os.path.join(bindir, "minipaged-worker"), "--metadata", f"127.0.0.1:{port}",
                                   "--port", "0", "--model", "tiny", "--kv-cache-bytes", str(8 << 20)],
                                  cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        r = subprocess.run([os.path.join(bindir, "minipaged"), "generate", "--address", f"127.0.0.1:{port}",
                            "--prompt", "Hi", "--max-new-tokens", "3", "--json", "--wait-ready", "240"],
                           cwd=cwd, capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr + log_path.read_text()
        assert '"finish_reason": "length"' in r.stdout
    finally:
        worker.terminate()
        worker.wait(30)
    log = log_path.read_text()
    assert "CPU kernels unavailable" not in log, log
    built = [os.path.join(d, f) for d, _, files in os.walk(cache) for f in files if f.endswith(".so")]
    assert built and all(b.startswith(str(cache / "minipaged" / "cpu_kernels")) for b in built), built
    assert not os.path.exists(os.path.join(pkg, "build"))


def test_pip_install_editable(tmp_path):
    src = _clean_copy(tmp_path / "src")
    py = _venv(tmp_path / "venv")
    _pip_install(py, "-e", ".", cwd=src)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert _where(py, elsewhere) == os.path.join(src, "client", "__init__.py")
