"""`make compose-test`: build the images and run the compose stack for real, on this machine.

What it does, in order (every step timed; any failure stops it with the services' logs):
 1. a Docker daemon: uses one that answers, else starts one with ../shared/docker/dockerd-up.sh
    (which installs docker.io, docker-compose and debootstrap from Debian when missing; the daemon
    has no default bridge). `docker network ls` must list only host and none, before, during, after.
 2. images: the base (local/python:3.11-bookworm from Debian packages when there is no registry,
    ../shared/docker/local-base.sh), the CPU torch wheel this machine's pip finds copied into
    docker/wheels/cpu, then the project's CPU image. All cached between runs on the same machine.
 3. a reference run: LocalCluster (host processes) with the same model and dtype.
 4. the stack from docker-compose.host.yml (host networking, every service on 127.0.0.1 with its
    own port, tokens from secret files), waited for healthy and ready; then through its published
    entry points, from the host's SDK:
    - without the client token: UNAUTHENTICATED; the ports listen on 127.0.0.1 only; /metrics of
      the metadata service and both workers;
    - a streamed generate and a 32-prompt job: token-exact against the reference;
    - a worker container's process killed (SIGKILL) mid-job: the restart policy brings it back and
      the job finishes exact;
    - `docker-compose restart metadata` mid-job: the job survives on the volume, exact;
    - `stop` (every container exits 0: SIGTERM drained within stop_grace_period), `down`, `up`:
      the finished jobs are still readable from the job store;
    - the gateway, when gateway/ exists: GET /health and one POST /v1/completions.
 5. always, even on failure or SIGTERM: `down -v`, and the daemon stopped if this run started it.

It never skips: what does not work fails the run. Settings (environment): COMPOSE_TEST_PROJECT,
COMPOSE_TEST_BASE_IMAGE, COMPOSE_TEST_<VARIABLE> for each port variable of docker-compose.host.yml
(METADATA_PORT 51051, METADATA_WORKER_PORT 51052, WORKER0_PORT 51061, WORKER1_PORT 51062, GATEWAY_PORT
51080, METADATA_METRICS_PORT 51100, WORKERn_METRICS_PORT 51101/51102: clear of the default ports
other tests use), MINIPAGED_SHARED_DOCKER.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import urllib.error
import urllib.request

# the settings and the docker plumbing (scripts/compose_stack.py, which also puts the repo on sys.path);
# scripts/ is on sys.path already when this runs as a script, not when it is imported from elsewhere
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compose_stack import (BASE_IMAGE, COMPOSE_FILE, DAEMON_PIDFILE, GATEWAY_PROMPT, HAS_GATEWAY,  # noqa: E402
                           MODEL, PORTS, REPO, SHARED, Failed, Run, Stack, check_networks, clean_up,
                           docker_answers, listening_addresses, log, print_summary, python_child, run, step)
from compose_workload import expect_exact, reference, wait_progress, workload  # noqa: E402

from client import Client  # noqa: E402
from client.errors import MiniPagedError, Unauthenticated  # noqa: E402


# ------------------------------------------------------------------ the run

def on_signal(signum, frame):
    raise SystemExit(128 + signum)   # unwinds into main()'s finally: down -v, daemon stopped


def main() -> int:
    for sig in (signal.SIGTERM, signal.SIGHUP):  # clean up on CI cancellation too (SIGINT: KeyboardInterrupt)
        signal.signal(sig, on_signal)
    r = Run(workdir=tempfile.mkdtemp(prefix="minipaged-compose-test-"))
    try:
        with step("docker daemon"):
            docker_daemon(r)
        with step("base image"):
            base_image(r.workdir)
        with step("torch CPU wheel into docker/wheels/cpu"):
            torch_wheel()
        r.stack = stack = Stack(r.workdir)
        with step("docker-compose config: both files, both profiles"):
            compose_config(stack)
        with step("build the CPU image (cached between runs)"):
            build_image(stack)
        work = workload()
        with step("reference: LocalCluster, same model and dtype"):
            ref = reference(work)
        with step("up (host networking) until healthy and ready"):
            up_healthy_on_loopback(stack)
        with step("auth: no token -> UNAUTHENTICATED; no client API on the internal port"):
            auth_checks(stack)
        with step("metrics: GET /metrics of the metadata service and both workers"):
            metrics_checks()
        with step("streamed generate + 32-prompt job, token-exact"):
            jobs = stream_and_job(stack, work, ref)
        with step("worker crash mid-job: SIGKILL in worker1-cpu, restart policy, job exact"):
            worker_crash(stack, work, ref, jobs)
        with step("docker-compose restart metadata mid-job: job survives on the volume, exact"):
            restart_metadata(stack, work, ref, jobs)
        if HAS_GATEWAY:
            with step("gateway: GET /health, POST /v1/completions"):
                gateway_checks(stack, ref["gateway_text"])
        with step("stop (graceful: exit 0), down, up: finished jobs still readable"):
            stop_down_up(stack, ref, jobs)
        r.ok = True
    except BaseException as e:  # noqa: BLE001 - report, clean up, fail
        log(f"FAILED: {type(e).__name__}: {e}")
        if r.stack is not None:
            try:
                r.stack.logs()
            except Exception as e2:  # noqa: BLE001
                log(f"(no logs: {e2})")
    finally:
        with step("down -v" + (", stop the daemon this run started" if r.started_daemon else "")):
            clean_up(r)
        print_summary(r.ok)
    return 0 if r.ok else 1


def docker_daemon(r: Run) -> None:
    if docker_answers() and shutil.which("docker-compose"):
        log("a Docker daemon answers: using it (and leaving it running)")
    else:
        if not os.path.isdir(SHARED):
            raise Failed(f"no daemon answers and {SHARED} (dockerd-up.sh) does not exist")
        r.started_daemon = not docker_answers()
        run([os.path.join(SHARED, "dockerd-up.sh")], env={**os.environ, "DOCKERD_PID": DAEMON_PIDFILE})
        if not docker_answers():
            raise Failed("dockerd-up.sh ran but no daemon answers")
    run(["docker", "version", "--format", "client {{.Client.Version}}, server {{.Server.Version}}"])
    run(["docker-compose", "version", "--short"])
    check_networks("before")


def base_image(workdir: str) -> None:
    if BASE_IMAGE.startswith("local/"):
        run([os.path.join(SHARED, "local-base.sh")],
            env={**os.environ, "WORKDIR": os.path.join(workdir, "local-base")})
    elif run(["docker", "image", "inspect", BASE_IMAGE], check=False, capture=True).returncode:
        run(["docker", "pull", BASE_IMAGE])


def torch_wheel() -> None:
    version = re.search(r"^ARG TORCH_VERSION=(\S+)$", open(os.path.join(REPO, "docker", "Dockerfile.cpu")).read(),
                        re.M).group(1)
    folder = os.path.join(REPO, "docker", "wheels", "cpu")
    if not any(n.startswith(f"torch-{version}+cpu") for n in os.listdir(folder)):
        run([sys.executable, "-m", "pip", "download", "-q", f"torch=={version}", "--no-deps", "-d", folder])
    wheels = [n for n in os.listdir(folder) if n.startswith(f"torch-{version}")]
    if not any("+cpu" in n for n in wheels):
        raise Failed(f"pip found no CPU build of torch {version} ({wheels}); the image would be the "
                     f"CUDA build. Put torch-{version}+cpu-*.whl into {folder} or make the index reachable")
    log(f"   {', '.join(wheels)}")


def compose_config(stack: Stack) -> None:
    for path in ("docker-compose.yml", COMPOSE_FILE):   # the bridge file cannot run here; it must parse
        for profile in ("cpu", "gpu"):
            run(["docker-compose", "-f", path, "--profile", profile, "config", "-q"], env=stack.env)


def build_image(stack: Stack) -> None:
    args = ["--network", "host", "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "-f", "docker/Dockerfile.cpu"]
    # the deps stage under a tag of its own, so that pruning old build stages keeps its cache
    run(["docker", "build", "-q", *args, "--target", "deps", "-t", "minipaged-qwen:cpu-deps", "."])
    stack.compose("build", "-q", "metadata")
    for label in ("org.minipaged.stage", "org.opencontainers.image.title=minipaged-qwen"):
        run(["docker", "image", "prune", "-f", "--filter", f"label={label}"], capture=True)
    run(["docker", "image", "ls", "--format", "table {{.Repository}}:{{.Tag}}\t{{.Size}}",
         "--filter", "reference=minipaged-qwen", "--filter", "reference=local/*"])


def up_healthy_on_loopback(stack: Stack) -> None:
    stack.compose("down", "-v", check=False, capture=True)   # leftovers of an interrupted run
    stack.up()
    log(f"   healthy and ready {stack.wait_healthy():.1f}s after up")
    check_networks("during the run")
    run(["docker", "network", "ls"])
    running = set(stack.containers())
    log(f"   containers: {sorted(running)}")
    if running & {"worker0", "worker1"}:
        raise Failed("a GPU worker started on a CPU-only run")
    checked = {n: p for n, p in PORTS.items() if n != "GATEWAY_PORT" or HAS_GATEWAY}
    for name, port in checked.items():
        addrs = listening_addresses(port)
        if addrs != {"127.0.0.1"}:
            raise Failed(f"port {port} ({name}) listens on {addrs or 'nothing'}, expected 127.0.0.1 only")
    log(f"   listening on 127.0.0.1 only: {sorted(checked.values())}")


def auth_checks(stack: Stack) -> None:
    try:
        Client(stack.address, timeout=5).stats()
        raise Failed("the client API answered without the client token")
    except Unauthenticated as e:
        log(f"   refused: {e}")
    internal = f"127.0.0.1:{PORTS['METADATA_WORKER_PORT']}"
    try:
        Client(internal, token=stack.client_token, timeout=5).stats()
        raise Failed(f"the client API answered on the internal surface {internal}")
    except MiniPagedError as e:
        log(f"   the internal surface {internal} refuses the client API: {type(e).__name__}")


def metrics_checks() -> None:
    for name in ("METADATA_METRICS_PORT", "WORKER0_METRICS_PORT", "WORKER1_METRICS_PORT"):
        url = f"http://127.0.0.1:{PORTS[name]}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        series = {line.split("{")[0].split()[0] for line in text.splitlines() if line and line[0] != "#"}
        if r.status != 200 or not series:
            raise Failed(f"{url}: {r.status}, no series")
        log(f"   {url} -> {r.status}, {len(series)} series, e.g. {sorted(series)[:3]}")


def stream_and_job(stack: Stack, work: dict, ref: dict) -> dict[str, str]:
    """The stream and job A, token-exact; returns {job name: job id} for the steps after it."""
    with stack.client() as c:
        chunks = list(c.stream(**work["stream"]))
        log(f"   stream: {len(chunks)} chunks")
        expect_exact("stream", [t for ch in chunks for t in ch.token_ids], ref["stream"], "tokens")
        jobs = {"A": c.submit(work["jobs"]["A"])}
        expect_exact("job A", [r.token_ids for r in c.wait(jobs["A"], timeout=600)], ref["A"])
    return jobs


def worker_crash(stack: Stack, work: dict, ref: dict, jobs: dict[str, str]) -> None:
    with stack.client() as c:
        before = stack.containers()["worker1-cpu"]
        jobs["B"] = c.submit(work["jobs"]["B"])
        wait_progress(c, jobs["B"], steps=10)
        victim = python_child(before["pid"])
        log(f"   kill -9 {victim} (worker1-cpu's python, what a crash or the OOM killer does)")
        os.kill(victim, signal.SIGKILL)
        state = c.get_job(jobs["B"])
        log(f"   job B at the crash: {state.completed}/{state.total} done")
        if state.done:
            raise Failed("job B finished before the crash; make it longer")
        results = c.wait(jobs["B"], timeout=600)
        after = stack.containers()["worker1-cpu"]
        if after["restarts"] != before["restarts"] + 1:
            raise Failed(f"worker1-cpu restarts {before['restarts']} -> {after['restarts']}, expected +1")
        log(f"   worker1-cpu restarted by the policy (RestartCount {after['restarts']})")
        expect_exact("job B", [r.token_ids for r in results], ref["B"])


def restart_metadata(stack: Stack, work: dict, ref: dict, jobs: dict[str, str]) -> None:
    with stack.client() as c, cf.ThreadPoolExecutor(1) as pool:
        jobs["C"] = c.submit(work["jobs"]["C"])
        wait_progress(c, jobs["C"], steps=10)
        waiting = pool.submit(stack.client().wait, jobs["C"], timeout=600)  # follows it across
        stack.compose("restart", "metadata")
        expect_exact("job C", [r.token_ids for r in waiting.result()], ref["C"])
    stack.wait_healthy()


def stop_down_up(stack: Stack, ref: dict, jobs: dict[str, str]) -> None:
    stack.compose("stop")
    codes = {s: v["exit_code"] for s, v in stack.containers().items()}
    log(f"   exit codes after stop: {codes}")
    if any(codes.values()):
        raise Failed(f"not every service drained and exited 0 on SIGTERM (137: killed after "
                     f"stop_grace_period): {codes}")
    stack.compose("down")
    check_networks("after down")
    stack.up()
    stack.wait_healthy()
    with stack.client() as c:
        for name, job in jobs.items():
            status = c.get_job(job)
            if status.state != "done":
                raise Failed(f"job {name} is {status.state} after down/up")
            expect_exact(f"job {name} from the job store", [r.token_ids for r in status.results], ref[name])


def gateway_checks(stack: Stack, want_text: str) -> None:
    base = f"http://127.0.0.1:{PORTS['GATEWAY_PORT']}"
    token = stack.read_secret("gateway_token")
    with urllib.request.urlopen(base + "/health", timeout=10) as r:
        log(f"   GET /health -> {r.status}")
        if r.status != 200:
            raise Failed(f"/health answered {r.status}")
    body = json.dumps({"model": MODEL, "prompt": GATEWAY_PROMPT["prompt"],
                       "max_tokens": GATEWAY_PROMPT["max_new_tokens"], "temperature": 0}).encode()
    request = lambda headers: urllib.request.Request(base + "/v1/completions", data=body, method="POST",  # noqa: E731
                                                     headers={"Content-Type": "application/json", **headers})
    try:
        urllib.request.urlopen(request({}), timeout=30)
        raise Failed("/v1/completions answered without the gateway token")
    except urllib.error.HTTPError as e:
        log(f"   POST /v1/completions without the token -> {e.code}")
        if e.code != 401:
            raise Failed(f"expected 401 without the token, got {e.code}") from None
    with urllib.request.urlopen(request({"Authorization": f"Bearer {token}"}), timeout=60) as r:
        reply = json.loads(r.read())
    text = reply["choices"][0]["text"]
    log(f"   POST /v1/completions -> {r.status}, usage {reply.get('usage')}")
    if text != want_text:
        raise Failed(f"/v1/completions text {text!r} differs from LocalCluster's {want_text!r}")
    log(f"   text equals LocalCluster's ({len(text)} chars)")


if __name__ == "__main__":
    sys.exit(main())
