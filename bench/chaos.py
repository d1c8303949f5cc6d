"""A chaos soak: steady load while workers are killed, hung and restarted, the metadata service is
restarted on its job store, and requests are cancelled. At the end every finished request must be
exact, no job lost or duplicated, every block free, every invariant true, and no process growing.

Load (float64, the embedded tiny model): jobs of 8 requests every ~2 s and 4 concurrent streams;
half greedy (a quarter of those with repetition_penalty 1.3; checked token for token against
transformers), half sampled with a seed (checked
against their own replay on the quiet cluster afterwards). Faults, one every 4-14 s at random:
kill -9 of a worker (restarted 1-3 s later), SIGSTOP of a worker for 2-8 s (beyond the lease or not),
a restart of the metadata service on its --db (kill -9 or SIGTERM), a cancelled job, a cancelled
stream. The cluster: 2 replica chains of 2 stages and a standby, lease 3 s.

With --shards N the service is a sharded front (`--shards N`) over 2 one-stage replicas and a
standby (whole-model workers spread over the shards; a default-group pipeline would sit in one
shard), and one more fault: kill -9 of a shard (the front starts it again on its store).

    .venv/bin/python bench/chaos.py --minutes 10 [--shards 2]
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import sqlite3
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from client import Client, LocalCluster  # noqa: E402
from client.errors import MiniPagedError  # noqa: E402

PROMPTS = [[random.Random(i).randrange(0, 256) for _ in range(random.Random(i).randint(4, 120))] for i in range(48)]


class Oracle:
    """transformers' greedy decoding of the tiny model in float64, cached per (prompt, n)."""

    def __init__(self):
        from transformers import Qwen3Config, Qwen3ForCausalLM

        from minipaged.config import TINY_CONFIG, load_model_config
        from worker.weights import tiny_state_dict
        self.model = Qwen3ForCausalLM(Qwen3Config(**TINY_CONFIG))
        self.model.load_state_dict(tiny_state_dict(load_model_config("tiny")), strict=False)
        self.model = self.model.double().eval()
        self.cache, self.lock = {}, threading.Lock()

    def __call__(self, prompt, n, repetition_penalty: float = 1.0):
        key = (tuple(prompt), n, repetition_penalty)
        with self.lock:
            if key not in self.cache:
                with torch.no_grad():
                    out = self.model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                              eos_token_id=256, pad_token_id=256,
                                              repetition_penalty=repetition_penalty)
                toks = out[0, len(prompt):].tolist()
                self.cache[key] = toks[:toks.index(256) + 1] if 256 in toks else toks
            return self.cache[key]


class Soak:
    def __init__(self, cluster: LocalCluster, seconds: float, seed: int):
        self.c, self.end = cluster, time.monotonic() + seconds
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.finished = []            # (request dict, token ids) of every finished greedy/sampled request
        self.jobs = []                # job ids submitted
        self.cancelled_jobs = set()
        self.faults = []
        self.interrupted_streams = 0
        self.cancelled_streams = 0
        self.errors = []
        self.shards = 1

    def request(self, rng):
        p = rng.choice(PROMPTS)
        r = {"prompt_token_ids": p, "max_new_tokens": rng.choice([8, 16, 32])}
        x = rng.random()
        if x < 0.5:
            r.update(temperature=0.9, top_p=0.95, seed=rng.randrange(1 << 30))
        elif x < 0.625:   # penalized: decodes ahead, its last token appended by the last stage
            r.update(repetition_penalty=1.3)
        return r

    # ------------------------------------------------------------------ load
    def jobs_loop(self):
        rng = random.Random(1)
        while time.monotonic() < self.end:
            reqs = [self.request(rng) for _ in range(8)]
            try:
                job = Client(self.c.address, timeout=10).submit(reqs)
            except MiniPagedError:
                time.sleep(0.5)        # the service is restarting: a real client retries
                continue
            with self.lock:
                self.jobs.append((job, reqs))
            threading.Thread(target=self.follow, args=(job, reqs), daemon=True).start()
            time.sleep(rng.uniform(1.0, 3.0))

    def follow(self, job, reqs):
        try:
            results = Client(self.c.address).wait(job, timeout=900)
        except MiniPagedError as e:
            with self.lock:
                self.errors.append(f"job {job}: {e}")
            return
        with self.lock:
            cancelled = job in self.cancelled_jobs
            for req, r in zip(reqs, results):
                if r.finish_reason == "cancelled" or (cancelled and r.finish_reason == "error"):
                    continue
                if r.error:
                    self.errors.append(f"job {job}[{r.index}]: {r.error}")
                    continue
                self.finished.append((req, r.token_ids))

    def streams_loop(self, k):
        rng = random.Random(100 + k)
        while time.monotonic() < self.end:
            req = self.request(rng)
            cancel_after = rng.randint(1, 4) if rng.random() < 0.1 else None
            try:
                toks = []
                for i, ch in enumerate(Client(self.c.address, timeout=120).stream(**req)):
                    toks += ch.token_ids
                    if cancel_after is not None and i + 1 >= cancel_after:
                        break
                if cancel_after is not None:
                    with self.lock:
                        self.cancelled_streams += 1
                        self.finished.append((dict(req, prefix=True), toks))
                else:
                    with self.lock:
                        self.finished.append((req, toks))
            except MiniPagedError:
                with self.lock:
                    self.interrupted_streams += 1   # a stream is not durable: the service restarted under it
                time.sleep(0.5)

    # ------------------------------------------------------------------ faults
    def chaos_loop(self):
        rng = self.rng
        time.sleep(20)  # warm-up
        while time.monotonic() < self.end - 20:
            time.sleep(rng.uniform(4, 14))
            kinds = ["kill", "kill", "stop", "stop", "restart_service", "cancel_job"]
            kind = rng.choice(kinds + (["kill_shard"] if self.shards > 1 else []))
            n_workers = len(self.c.processes) - 1
            try:
                if kind == "kill":
                    i = rng.randrange(n_workers)
                    self.c.kill_worker(i)
                    time.sleep(rng.uniform(1, 3))
                    self.c.restart_worker(i, wait=False)
                elif kind == "stop":
                    i = rng.randrange(n_workers)
                    p = self.c.processes[1 + i]
                    p.send_signal(signal.SIGSTOP)
                    time.sleep(rng.uniform(2, 8))
                    p.send_signal(signal.SIGCONT)
                elif kind == "kill_shard":
                    shards = self._shard_pids()
                    if not shards:
                        continue          # the front is itself restarting: no shard to kill yet
                    os.kill(rng.choice(shards), signal.SIGKILL)
                elif kind == "restart_service":
                    if rng.random() < 0.5:
                        self.c.processes[0].send_signal(signal.SIGKILL)
                        self.c.processes[0].wait()
                    self.c.restart_service(wait=False)
                else:
                    with self.lock:
                        live = [j for j, _ in self.jobs if j not in self.cancelled_jobs]
                        job = live[-1] if live else None
                    if job is None:
                        continue
                    Client(self.c.address, timeout=10).cancel(job)
                    with self.lock:
                        self.cancelled_jobs.add(job)
            except Exception as e:  # a fault that could not be injected is reported, not hidden
                self.errors.append(f"fault {kind}: {type(e).__name__}: {e}")
                continue
            self.faults.append((round(time.monotonic() - (self.end - self.seconds)), kind))

    def _shard_pids(self, wait_s: float = 10.0) -> list[int]:
        """The front's shard processes (its children); none while a restarted front starts them."""
        deadline = time.monotonic() + wait_s
        while True:
            pid = self.c.processes[0].pid
            try:
                with open(f"/proc/{pid}/task/{pid}/children") as f:
                    shards = [int(x) for x in f.read().split()]
            except OSError:
                shards = []
            if shards or time.monotonic() > deadline:
                return shards
            time.sleep(0.5)

    def rss(self):
        out = {}
        for i, p in enumerate(self.c.processes):
            try:
                with open(f"/proc/{p.pid}/status") as f:
                    kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
                out[("metadata_service" if i == 0 else f"worker{i - 1}", p.pid)] = kb // 1024
            except (OSError, StopIteration):
                pass
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=1, help="a sharded service (--shards N) and shard kills")
    args = ap.parse_args()
    oracle = Oracle()
    db = os.path.join(tempfile.mkdtemp(prefix="minipaged-chaos-"), "jobs.db")
    t_start = time.time()
    shards = ["--shards", str(args.shards)] if args.shards > 1 else []
    with LocalCluster(model="tiny", workers=1 if shards else 2, replicas=2, standby=1, dtype="float64", db=db,
                      startup_timeout=300,
                      extra_service_args=["--worker-lease", "3", "--worker-wait", "120"] + shards) as c:
        soak = Soak(c, args.minutes * 60, args.seed)
        soak.shards = args.shards
        soak.seconds = args.minutes * 60
        threads = [threading.Thread(target=soak.jobs_loop, daemon=True),
                   threading.Thread(target=soak.chaos_loop, daemon=True)]
        threads += [threading.Thread(target=soak.streams_loop, args=(k,), daemon=True) for k in range(4)]
        for t in threads:
            t.start()
        time.sleep(60)
        rss_start = soak.rss()                  # after warm-up
        for t in threads:
            t.join()
        deadline = time.monotonic() + 900       # let every job finish
        while time.monotonic() < deadline:
            try:
                cl = Client(c.address, timeout=10)
                if all(cl.get_job(j).done for j, _ in soak.jobs):
                    break
            except MiniPagedError:
                pass
            time.sleep(1)
        time.sleep(3)
        rss_end = soak.rss()
        cl = Client(c.address, timeout=60)
        c.wait_ready()
        # exactness: greedy against transformers, sampled against their own replay now
        wrong = []
        for req, toks in soak.finished:
            clean = {k: v for k, v in req.items() if k != "prefix"}
            if "seed" in clean:
                want = cl.generate(**clean).token_ids
            else:
                want = oracle(clean["prompt_token_ids"], clean["max_new_tokens"], clean.get("repetition_penalty", 1.0))
            if (toks != want[:len(toks)]) if req.get("prefix") else (toks != want):
                wrong.append((clean, toks, want))
        st = cl.stats()
        settled = st.running == 0 and st.waiting == 0 and st.free_blocks == st.num_blocks and st.invariants_ok
    rows, states = {}, {}
    for path in [db] if args.shards == 1 else [f"{db}.shard{k}" for k in range(args.shards)]:
        with sqlite3.connect(path) as con:       # no job lost, none stored twice (a job's parts summed)
            for j, n in con.execute("SELECT job_id, COUNT(*) FROM requests WHERE result IS NOT NULL GROUP BY job_id"):
                rows[j] = rows.get(j, 0) + n
            for j, st in con.execute("SELECT job_id, state FROM jobs"):
                states[j] = st if states.get(j) in (None, st) else ("cancelled" if "cancelled" in (st, states[j])
                                                                     else "running")
    lost = [j for j, reqs in soak.jobs if states.get(j) not in ("done", "cancelled")
            or (states.get(j) == "done" and rows.get(j, 0) != len(reqs))]
    kinds = {}
    for _, k in soak.faults:
        kinds[k] = kinds.get(k, 0) + 1
    print(f"\nchaos soak: {args.minutes:.0f} min, {time.time() - t_start:.0f} s wall in all, seed {args.seed}")
    print(f"| faults injected | {len(soak.faults)} ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}) |")
    print(f"| requests finished and checked | {len(soak.finished)} (jobs {len(soak.jobs)}, "
          f"{len(soak.cancelled_jobs)} cancelled; streams cancelled early {soak.cancelled_streams}, "
          f"interrupted by a service restart and retried {soak.interrupted_streams}) |")
    print(f"| wrong | {len(wrong)} |")
    print(f"| lost or duplicated jobs | {len(lost)} |")
    print(f"| end state | every block free and invariants_ok: {settled} |")
    print(f"| errors reported to clients | {len(soak.errors)} |")
    for key in sorted(set(rss_start) & set(rss_end)):
        print(f"| RSS {key[0]} (pid {key[1]}) | {rss_start[key]} MB after warm-up -> {rss_end[key]} MB at the end |")
    for e in soak.errors[:10]:
        print("  error:", e)
    for clean, toks, want in wrong[:5]:
        print("  WRONG:", clean, toks, want)
    return 0 if not wrong and not lost and settled else 1


if __name__ == "__main__":
    sys.exit(main())
