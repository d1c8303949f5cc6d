"""vLLM's offline engine as the measuring anchor of bench/e2e.py and bench/beam.py: bench/vllm_offline.py
run in vLLM's own venv, driven over stdin/stdout. Its own module so that e2e.py stays a readable size;
e2e.py re-exports VllmAnchor (bench/beam.py imports it from there)."""
from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def exit_on_sigterm() -> None:
    """SIGTERM (timeout, CI, kill) as sys.exit: `finally` blocks and atexit run, so vLLM's process
    group is stopped (not left running, or SIGSTOPped for good) and the work directory goes."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def vllm_env(workdir: str, **defaults) -> dict:
    """vLLM's environment: ours without PYTHONPATH / OMP_NUM_THREADS, `defaults` where unset, and
    TMPDIR in `workdir`, so the ipc sockets its engine makes there go with the work directory (a
    killed engine leaves them behind in /tmp)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS")}
    for k, v in defaults.items():
        env.setdefault(k, v)
    env["TMPDIR"] = workdir
    return env


class VllmAnchor:
    """bench/vllm_offline.py in vLLM's venv: started once, one `run` per repetition."""

    def __init__(self, python: str, model_path: str, prompts, new_tokens: int, block_size: int, workdir: str,
                 env_extra: dict | None = None, tag: str = "vllm"):
        self.log_path, self.workdir = os.path.join(workdir, f"{tag}.log"), workdir
        prompts_file = self.prompts_file(prompts)
        env = vllm_env(workdir)
        env.update(env_extra or {})
        t0 = time.perf_counter()
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [python, os.path.join(ROOT, "bench", "vllm_offline.py"), model_path, prompts_file,
             str(new_tokens), str(block_size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=workdir, env=env,
            start_new_session=True)   # its own process group: paused, resumed and killed as one
        atexit.register(self.kill)
        ready = self._read()
        self.startup_s, self.version = time.perf_counter() - t0, ready["version"]  # incl. its warm-up

    def prompts_file(self, prompts) -> str:
        path = os.path.join(self.workdir, f"prompts-{abs(hash(json.dumps(prompts)))}.json")
        with open(path, "w") as f:
            json.dump(prompts, f)
        return path

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                msg = json.loads(line[3:])
                if "error" in msg:
                    raise RuntimeError(f"vLLM runner: {msg['error']}")
                return msg
        raise RuntimeError(f"vLLM runner exited (code {self.proc.wait()}); its log: {self.log_path}\n"
                           + open(self.log_path).read()[-3000:])

    def _signal(self, sig) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def pause(self) -> None:
        """Stop vLLM's processes while other rows run: its idle CPU worker polls its message queue
        on a whole core (measured: 100% CPU between runs), which would take a core from them."""
        self._signal(signal.SIGSTOP)

    def kill(self) -> None:
        """Every process of the runner's group (vLLM's engine and worker outlive a killed parent)."""
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGKILL)

    def run(self, prompts=None, new_tokens: int = 0) -> dict:
        self._signal(signal.SIGCONT)
        cmd = f"run {self.prompts_file(prompts)} {new_tokens}\n" if prompts is not None else "run\n"
        self.proc.stdin.write(cmd)
        self.proc.stdin.flush()
        r = self._read()
        return dict(wall=r["wall"], tokens=r["tokens"], util=float("nan"), meta_ms=None,
                    startup=self.startup_s, rss=r.get("rss", {}))

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.kill()
        self.log.close()
