"""The job store on its own: in memory unless asked, one owner at a time, one clear line for a bad
path, old stores upgraded; and the words that explain pending work (issue 24, issue 21)."""
from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from client.cli_args import _age
from metadata_service.__main__ import parse_args
from metadata_service.backlog import Backlog, age_words, waiting_reason
from metadata_service.job_store import JobStore, JobStoreError
from metadata_service.stats_log import Sample, stats_line
from minipaged.units import human_bytes, kv_capacity
from minipaged.v1 import metadata_pb2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _req(n=3):
    return [metadata_pb2.GenerateRequest(prompt=f"p{i}", max_new_tokens=4) for i in range(n)]


def test_without_db_the_store_is_in_memory_and_writes_no_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_args([]).db == ""          # not a relative data/jobs.db that unrelated runs share
    # durations and weights out of range (NaN too) stop the start with one line, not a silent misbehaviour
    for bad in (["--worker-lease", "0"], ["--step-timeout", "nan"], ["--router-overlap-weight", "-1"],
                ["--block-size", "0"], ["--max-num-seqs", "0"], ["--num-blocks", "-1"],
                ["--max-num-batched-tokens", "0"], ["--micro-batches", "-1"], ["--max-model-len", "-5"],
                ["--num-blocks", "99999999999"],        # (probe M: hangs, a refusal of everything, a numpy traceback)
                ["--po", "5"]):      # no abbreviations: a sharded front passes its flags on by full name
        with pytest.raises(SystemExit):
            parse_args(bad)
    store = JobStore(parse_args([]).db)
    store.create("j", _req())
    assert not store.durable and store.unfinished()[0][0] == "j"
    store.close()
    assert os.listdir(tmp_path) == []


def test_a_file_store_has_one_owner_at_a_time(tmp_path):
    path = str(tmp_path / "jobs.db")
    first = JobStore(path, owner="metadata service pid 123 on host-a, port 50051")
    with pytest.raises(JobStoreError, match="in use by metadata service pid 123 on host-a, port 50051"):
        JobStore(path)
    first.close()                           # the lock goes with its owner
    JobStore(path).close()


def test_another_name_of_the_same_store_is_refused_too(tmp_path):
    """A symlink or a hard link to a store in use is the same store (found by probing: two services
    resumed the same jobs through jobs.db and a link to it)."""
    path = tmp_path / "jobs.db"
    first = JobStore(str(path), owner="the first service")
    (tmp_path / "alias.db").symlink_to(path)
    os.link(path, tmp_path / "hard.db")
    with pytest.raises(JobStoreError, match="in use by the first service"):
        JobStore(str(tmp_path / "alias.db"))
    with pytest.raises(JobStoreError, match="in use by another process"):
        JobStore(str(tmp_path / "hard.db"))
    first.close()
    JobStore(str(tmp_path / "hard.db")).close()


def test_another_applications_database_is_left_untouched(tmp_path):
    path = str(tmp_path / "app.db")
    with sqlite3.connect(path) as con:
        con.execute("CREATE TABLE customers (id INTEGER)")
    with pytest.raises(JobStoreError, match=r"a SQLite database of something else \(tables: customers\)"):
        JobStore(path)
    with sqlite3.connect(path) as con:
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        assert tables == ["customers"] and con.execute("PRAGMA journal_mode").fetchone()[0] == "delete"


def test_a_damaged_request_row_ends_with_an_error_and_the_rest_resume(tmp_path):
    path = str(tmp_path / "jobs.db")
    store = JobStore(path)
    store.create("j", _req(3), "m", "f" * 16)
    store._db.execute("UPDATE requests SET request = ? WHERE idx = 1", (b"\xff\xff\xff",))
    store.close()
    store = JobStore(path)
    (job_id, _, _, pending), = store.unfinished()
    assert [i for i, _ in pending] == [0, 2]
    blob = store._db.execute("SELECT result FROM requests WHERE idx = 1").fetchone()[0]
    assert "damaged in the job store" in metadata_pb2.GenerationResult.FromString(blob).error
    store.close()


def _service(*args):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "metadata_service", "--port", "0", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def test_a_bad_db_path_is_one_line_naming_the_file(tmp_path):
    missing = tmp_path / "nope" / "jobs.db"
    junk = tmp_path / "notes.txt"
    junk.write_text("not a database\n")
    for path, words in ((missing, "does not exist"), (junk, "not a usable SQLite job store"),
                        (tmp_path, "is a directory"), ("/proc/minipaged-jobs.db", "cannot open")):   # unwritable
        r = _service("--db", str(path))
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and str(path) in lines[0] and words in lines[0], r.stderr
    assert not missing.parent.exists()      # nothing created on the way
    # a sharded front checks its shards' stores first (each shard would fail, and restart, for a minute)
    for path, words in ((missing, "does not exist"), (tmp_path, "is a directory")):
        r = _service("--shards", "2", "--db", str(path))
        assert r.returncode == 1 and "Traceback" not in r.stderr and words in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_store_from_before_the_model_columns_is_upgraded(tmp_path):
    path = str(tmp_path / "old.db")
    with sqlite3.connect(path) as con:      # the schema of the first release, one unfinished job
        con.executescript("""
            CREATE TABLE jobs (job_id TEXT PRIMARY KEY, created REAL NOT NULL, state TEXT NOT NULL,
                               total INTEGER NOT NULL);
            CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
            CREATE TABLE requests (job_id TEXT NOT NULL, idx INTEGER NOT NULL, request BLOB NOT NULL,
                                   result BLOB, PRIMARY KEY (job_id, idx));""")
        con.execute("INSERT INTO jobs VALUES ('old', 1.0, 'queued', 1)")
        con.execute("INSERT INTO requests VALUES ('old', 0, ?, NULL)", (_req(1)[0].SerializeToString(),))
        con.execute("INSERT INTO meta VALUES ('model_name', '/tmp/gone'), ('model_fingerprint', 'abcdef0123456789')")
    store = JobStore(path)
    (job_id, name, fp, pending), = store.unfinished()
    assert (job_id, name, fp, len(pending)) == ("old", "/tmp/gone", "abcdef0123456789", 1)
    store.close()


def test_purge_finds_only_finished_jobs_past_the_age():
    store = JobStore()
    for job_id in ("done", "cancelled", "running"):
        store.create(job_id, _req(), "m", "f" * 16)
    store.set_state("done", "done")
    store.set_state("cancelled", "cancelled")
    store.set_state("running", "running")
    assert sorted(store.finished_before(time.time() + 1)) == ["cancelled", "done"]
    assert store.finished_before(time.time() - 3600) == []
    assert store.delete_many(["done", "cancelled"]) == 2
    assert [row[0] for row in store.list_jobs(10)] == ["running"]
    assert store._db.execute("SELECT COUNT(*) FROM requests").fetchone()[0] == 3  # none orphaned


def test_the_waiting_reason_names_model_count_date_and_the_way_out():
    b = Backlog("/tmp/ckpt", "0123456789abcdef", jobs=2, requests=15, oldest=time.time() - 7300)
    text = waiting_reason([b], "minipaged jobs --cancel-all --address 127.0.0.1:6000")
    assert "waiting for a worker of model /tmp/ckpt (fingerprint 0123456789ab)" in text
    assert "15 pending requests from 20" in text and "(2 h 1 min ago)" in text
    assert text.endswith("to drop them: minipaged jobs --cancel-all --address 127.0.0.1:6000")
    assert waiting_reason([]) == "" and age_words(59) == "59 s" and age_words(2 * 86400 + 3600) == "2 d 1 h"


def test_the_stats_line_reports_the_interval_and_stays_quiet_when_idle():
    st = {"running": 3, "waiting": 5, "num_blocks": 1024, "used_blocks": 256}
    line = stats_line(Sample(0.0, 100, 10, 10, 4), Sample(10.0, 1100, 510, 20, 9), st)
    assert line == ("running: 3 reqs, waiting: 5 reqs, prompt throughput: 100.0 tok/s, generation throughput: "
                    "50.0 tok/s, KV usage: 25.0% (256 of 1024 blocks), prefix cache hit rate: 50.0%")
    same = Sample(20.0, 1100, 510, 20, 9)
    assert stats_line(same, Sample(30.0, 1100, 510, 20, 9), {"running": 0, "waiting": 0}) is None
    stuck = {"running": 0, "waiting": 30}      # no worker: said once, not every interval
    assert stats_line(same, same, stuck, (0, 0)) is not None
    assert stats_line(same, same, stuck, (0, 30)) is None


def test_kv_capacity_in_human_units():
    assert kv_capacity(1024, 16, 112 << 20) == "1024 blocks x 16 tokens = 16,384 tokens, 112 MiB"
    assert human_bytes(512) == "512 B" and human_bytes(3 << 30) == "3 GiB" and human_bytes(1536) == "1.5 KiB"


def test_ages_on_the_command_line():
    assert (_age("90"), _age("30m"), _age("12h"), _age("7d")) == (90, 1800, 43200, 604800)
    for bad in ("0", "-1h", "soon", "inf", ""):
        with pytest.raises(Exception, match="expected an age"):
            _age(bad)


def test_deferred_writes_land_together_at_the_end_of_the_block(tmp_path):
    """A step's finished results and the job's state go to the file in one transaction."""
    path = str(tmp_path / "jobs.db")
    store = JobStore(path)
    req = metadata_pb2.GenerateRequest(max_new_tokens=1)
    store.create("j", [req, req])
    other = sqlite3.connect(path)                       # another connection sees only committed rows
    done = lambda: other.execute("SELECT COUNT(*) FROM requests WHERE result IS NOT NULL").fetchone()[0]
    with store.deferred():
        with store.deferred():                          # nested: joins the outer transaction
            store.save_result("j", metadata_pb2.GenerationResult(index=0, finish_reason="length"))
        store.save_result("j", metadata_pb2.GenerationResult(index=1, finish_reason="length"))
        store.set_state("j", "done")
        assert done() == 0
    assert done() == 2
    assert other.execute("SELECT state FROM jobs").fetchone()[0] == "done"
    assert store.save_result("j", metadata_pb2.GenerationResult(index=1)) is False   # stored once
    state, total, results = store.job("j")
    assert (state, total, sorted(results)) == ("done", 2, [0, 1])


def test_a_job_whose_first_requests_finish_while_the_rest_are_added():
    """The engine may finish a request (another thread) before the job has added all of them."""
    from metadata_service.jobs import JobManager
    from metadata_service.sequence import SeqEvent
    from minipaged import wire

    class InstantEngine:                      # finishes every sequence as it is added
        model_name = model_fingerprint = ""
        eos_ids = ()
        on_model_known: list = []
        model_known = threading.Event()
        model_known.set()

        def add(self, seq):
            seq.output_token_ids = [7]
            seq.sink(seq, SeqEvent([7], [], finished=True, finish_reason="length"))

        def decode(self, ids):
            return ""

    jobs = JobManager(InstantEngine(), JobStore())
    reqs = [metadata_pb2.GenerateRequest(prompt_token_ids=wire.pack([1, 2, 3]), max_new_tokens=1) for _ in range(5)]
    job_id = jobs.submit(reqs)
    job = jobs.get(job_id)
    assert job.state == "done" and sorted(job.results) == [0, 1, 2, 3, 4]
