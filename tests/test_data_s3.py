"""Preparing from and into S3 through pyarrow.fs, against moto's S3 server on loopback."""

import os
import socket
import subprocess
import sys

import numpy as np
import pyarrow.fs as pafs
import pytest

from elastic_llm.data import load_split, prepare, read_meta

from .conftest import wait_until

pytestmark = pytest.mark.timeout(120)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
    port = free_port()
    env = dict(os.environ, AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", AWS_DEFAULT_REGION="us-east-1")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    def listening():
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return True
        except OSError:
            return False

    try:
        wait_until(listening, 30, "the moto server's start")
    except AssertionError:
        proc.kill()
        raise
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_EC2_METADATA_DISABLED")}
    os.environ.update(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", AWS_EC2_METADATA_DISABLED="true")
    fs = pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", region="us-east-1", allow_bucket_creation=True)
    fs.create_dir("corpus")
    yield fs, f"endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
    proc.kill()
    proc.wait()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_prepare_from_s3_sources_into_s3_shards(s3, tmp_path):
    fs, query = s3
    for i in range(20):
        with fs.open_output_stream(f"corpus/raw/doc{i:02d}.txt") as f:
            f.write(f"document {i}: the quick brown fox jumps over the lazy dog\n".encode() * 20)
    meta = prepare([f"s3://corpus/raw?{query}"], f"s3://corpus/shards?{query}", val_fraction=0.25)
    assert meta["documents"] == 20
    assert read_meta(f"s3://corpus/shards?{query}") == meta
    remote = np.concatenate([load_split(f"s3://corpus/shards?{query}", s) for s in ("train", "val")])
    prepare([f"s3://corpus/raw?{query}"], tmp_path / "local", val_fraction=0.25)
    local = np.concatenate([load_split(tmp_path / "local", s) for s in ("train", "val")])
    np.testing.assert_array_equal(remote, local)
