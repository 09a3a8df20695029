"""The disk KV store on its own: round trip, corruption, other models, LRU budget, keyed names, stale temp files."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
from ds4_server.kvstore import DiskKVStore, model_identity

from ds4_core.engine import Snapshot


def snap(tokens: list[int], fill: float = 1.0, size: int = 1000) -> Snapshot:
    return Snapshot(tuple(tokens), {"k": np.full(size, fill, np.float32)}, np.arange(4, dtype=np.float32))


def test_round_trip_longest_prefix(tmp_path):
    store = DiskKVStore(tmp_path, 10**6, model_id="m")
    assert store.save(snap([1, 2, 3])) and store.save(snap([1, 2, 3, 4, 5], 2.0))
    hit = DiskKVStore(tmp_path, 10**6, model_id="m").lookup([1, 2, 3, 4, 5, 6])  # a fresh process's view
    assert hit.tokens == (1, 2, 3, 4, 5) and hit.state["k"][0] == 2.0
    assert store.lookup([1, 2, 9]) is None and store.lookup([7]) is None
    assert (tmp_path.stat().st_mode & 0o777) == 0o700 and ((tmp_path / "key").stat().st_mode & 0o777) == 0o600


def test_flipped_bit_and_truncation_are_misses_and_deleted(tmp_path):
    store = DiskKVStore(tmp_path, 10**6, model_id="m")
    store.save(snap([1, 2]))
    store.save(snap([3, 4]))
    (a, b) = sorted(tmp_path.glob("*.kv"), key=lambda p: p.stat().st_mtime)
    data = bytearray(a.read_bytes())
    data[-100] ^= 0x10
    a.write_bytes(bytes(data))
    b.write_bytes(b.read_bytes()[:-50])
    assert store.lookup([1, 2]) is None and store.lookup([3, 4]) is None
    assert list(tmp_path.glob("*.kv")) == []


def test_other_models_files_are_ignored_not_served(tmp_path):
    DiskKVStore(tmp_path, 10**6, model_id="model-a").save(snap([1, 2]))
    other = DiskKVStore(tmp_path, 10**6, model_id="model-b")
    assert other.lookup([1, 2]) is None and other.index == {}
    assert len(list(tmp_path.glob("*.kv"))) == 1  # left for its own model


def test_lru_eviction_keeps_within_budget(tmp_path):
    one = len(snap([0]).state["k"].tobytes())
    store = DiskKVStore(tmp_path, int(one * 2.5), model_id="m")
    store.save(snap([1]))
    store.save(snap([2]))
    assert store.lookup([1]) is not None  # [1] is now more recently used than [2]
    store.save(snap([3]))
    assert store.used_bytes <= int(one * 2.5)
    assert store.lookup([2]) is None and store.lookup([1]) is not None and store.lookup([3]) is not None
    assert not store.save(snap([4], size=10**6))  # larger than the whole budget: skipped


def test_stale_temp_files_are_removed_at_startup(tmp_path):
    DiskKVStore(tmp_path, 10**6, model_id="m")
    (tmp_path / "abc.tmp.123.deadbeef").write_bytes(b"partial")
    DiskKVStore(tmp_path, 10**6, model_id="m")
    assert not list(tmp_path.glob("*.tmp.*"))


def test_key_is_keyed_and_independent_of_python_hash_seed(tmp_path):
    code = ("import sys; from ds4_server.kvstore import DiskKVStore; "
            "print(DiskKVStore(sys.argv[1], 1, model_id='m').key_for([1, 2, 3]))")
    keys = {subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True,
                           env=dict(os.environ, PYTHONHASHSEED=seed)).stdout for seed in ("1", "2")}
    assert len(keys) == 1
    other_dir = DiskKVStore(tmp_path / "other", 1, model_id="m")
    assert other_dir.key_for([1, 2, 3]) != keys.pop().strip()  # a different secret gives different names


def test_model_identity_covers_metadata(tmp_path):
    from ds4_scripted_fixture import write_scripted_gguf

    a = model_identity(write_scripted_gguf(tmp_path / "a.gguf"))
    assert a == model_identity(write_scripted_gguf(tmp_path / "a2.gguf"))
    assert a != model_identity(write_scripted_gguf(tmp_path / "b.gguf", ctx=512))
