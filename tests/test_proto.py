"""The generated gRPC code is reproducible from proto/ and not stale; the wire rules hold."""
import filecmp
import os
import subprocess
import sys

import numpy as np
import pytest

from minipaged.v1 import metadata_pb2, worker_pb2
from minipaged.wire import INT32, INT64, WireError, pack, unpack, unpack_2d

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_generated_code_is_fresh(tmp_path):
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gen_proto.py"), "--out", str(tmp_path)],
                   check=True)
    fresh = tmp_path / "minipaged" / "v1"
    committed = os.path.join(ROOT, "minipaged", "v1")
    names = sorted(f for f in os.listdir(fresh) if f.endswith((".py", ".pyi")))
    assert names == sorted(f for f in os.listdir(committed) if f.endswith((".py", ".pyi")))
    stale = [n for n in names if not filecmp.cmp(fresh / n, os.path.join(committed, n), shallow=False)]
    assert not stale, f"run `make proto`: {stale} differ from what proto/ generates"


def test_package_is_versioned():
    assert metadata_pb2.DESCRIPTOR.package == "minipaged.v1"
    assert set(metadata_pb2.DESCRIPTOR.services_by_name["MetadataService"].methods_by_name) >= {
        "Generate", "SubmitJob", "GetJob", "WatchJob", "CancelJob", "Stats", "CreateSequence", "AppendTokens",
        "ForkSequence", "ReleaseSequence", "GetBlockTables", "RegisterWorker", "Heartbeat", "ListJobs", "DeleteJob",
        "PoolSnapshot"}
    assert set(worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].methods_by_name) == {
        "Info", "InitCache", "Step", "StepStream", "StepResults", "SampledTokenStream", "Health"}


def test_integer_arrays_are_packed_bytes_not_repeated():
    """Design section 5: no `repeated` integer fields anywhere in the contract."""
    from google.protobuf.descriptor import FieldDescriptor as F
    for mod in (metadata_pb2, worker_pb2):
        for msg in mod.DESCRIPTOR.message_types_by_name.values():
            for f in msg.fields:
                repeated = getattr(f, "is_repeated", None)
                repeated = repeated if repeated is not None else f.label == F.LABEL_REPEATED
                if repeated:
                    assert f.type in (F.TYPE_MESSAGE, F.TYPE_STRING), f"{msg.name}.{f.name}"


def test_a_256x256_block_table_is_one_memcpy():
    table = np.arange(256 * 256, dtype=np.int32).reshape(256, 256)
    data = pack(table)
    assert len(data) == 256 * 256 * 4
    req = worker_pb2.StepRequest(block_tables=data, max_blocks_per_seq=256)
    back = unpack_2d(worker_pb2.StepRequest.FromString(req.SerializeToString()).block_tables, 256, 256)
    assert (back == table).all()


def test_wire_errors():
    with pytest.raises(WireError):
        unpack(b"\x00" * 5, INT32)
    with pytest.raises(WireError):
        unpack(pack([1, 2, 3], INT64), INT64, count=2)
    assert unpack(pack([-1, 7]), INT32).tolist() == [-1, 7]
