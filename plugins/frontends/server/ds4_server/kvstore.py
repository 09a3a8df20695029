"""Disk KV cache: session snapshots of useful prompt prefixes, kept across slot reuse and restarts.

One file per prefix, named by a keyed BLAKE2b hash of the model identity and the token ids. A file is
``MAGIC``, a little-endian u32 header length, a JSON header (format version, model identity, token
count, payload size and keyed BLAKE2b of the payload) and the payload: the pickled
:class:`ds4_core.engine.Snapshot`. The hash key is a random secret kept in the directory (mode 0700,
key file 0600), so only payloads written by a holder of the key are ever unpickled; anything that fails
a check is a miss and is deleted. Files of another model are ignored and left alone. Writes go to a
temporary file, are fsynced and renamed into place under an advisory lock; least recently used entries
are evicted to stay within the byte budget.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pickle
import secrets
import struct
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from ds4_core.engine import Snapshot
from ds4_core.files import fsync_dir
from ds4_core.log import get_logger

FORMAT_VERSION = 1
MAGIC = b"DS4KVC\x00\x01"
_HEADER_LEN = struct.Struct("<I")
_MAX_HEADER = 1 << 16
_SUFFIX = ".kv"


def model_identity(path: str | Path) -> str:
    """sha256 (hex) of a GGUF's header, metadata and tensor table: everything before the tensor data."""
    from ds4_core.gguf import GGUFFile

    with GGUFFile.open(path) as gguf:
        end = min((t.offset for t in gguf.tensors.values()), default=None)
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read(end) if end is not None else fh.read()).hexdigest()


@attrs.define
class _Entry:
    path: Path
    n_tokens: int
    size: int
    last_used: float


class DiskKVStore:
    """Prefix snapshots of one model in ``directory``, at most ``budget_bytes`` in total."""

    def __init__(self, directory: str | Path, budget_bytes: int, *, model_id: str):
        self.dir = Path(directory)
        self.budget = int(budget_bytes)
        self.model_id = model_id
        self.log = get_logger(component="kv-disk")
        self._lock = threading.Lock()
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self._secret = self._load_secret()
        self.index: dict[str, _Entry] = {}
        with self._file_lock():
            for stale in self.dir.glob("*.tmp.*"):
                stale.unlink(missing_ok=True)
            for path in self.dir.glob(f"*{_SUFFIX}"):
                header = self._read_header(path)
                if header is not None:
                    st = path.stat()
                    self.index[path.stem] = _Entry(path, int(header["n_tokens"]), st.st_size, st.st_mtime)

    # ---- keys and files ---------------------------------------------------------------------------------------

    def _load_secret(self) -> bytes:
        path = self.dir / "key"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return path.read_bytes()
        with os.fdopen(fd, "wb") as fh:
            fh.write(secrets.token_bytes(32))
            fh.flush()
            os.fsync(fh.fileno())
        return path.read_bytes()

    def key_for(self, tokens: Sequence[int]) -> str:
        """Keyed hash naming the entry for exactly ``tokens`` (never Python's ``hash()``)."""
        h = hashlib.blake2b(key=self._secret[:64], digest_size=20, person=b"ds4-kv-key")
        h.update(self.model_id.encode())
        h.update(np.asarray(tokens, dtype="<i8").tobytes())
        return h.hexdigest()

    def _checksum(self, payload: bytes) -> str:
        return hashlib.blake2b(payload, key=self._secret[:64], digest_size=32, person=b"ds4-kv-data").hexdigest()

    def _file_lock(self) -> Any:
        return _FileLock(self.dir / "lock")

    def _read_header(self, path: Path) -> dict[str, Any] | None:
        """The header of one of this model's files; None for another model's; corrupt files are deleted."""
        try:
            with open(path, "rb") as fh:
                head = fh.read(len(MAGIC) + _HEADER_LEN.size)
                if len(head) < len(MAGIC) + _HEADER_LEN.size or not head.startswith(MAGIC):
                    raise ValueError("bad magic")
                (n,) = _HEADER_LEN.unpack(head[len(MAGIC):])
                if n > _MAX_HEADER:
                    raise ValueError("header too long")
                header = json.loads(fh.read(n))
            if header.get("version") != FORMAT_VERSION:
                raise ValueError(f"format version {header.get('version')}")
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            self._drop(path, f"unreadable cache file ({exc})")
            return None
        if header.get("model_id") != self.model_id:
            return None
        return header

    def _drop(self, path: Path, why: str) -> None:
        self.log.warning("discarding KV cache entry", file=path.name, reason=why)
        self.index.pop(path.stem, None)
        path.unlink(missing_ok=True)

    # ---- lookup -----------------------------------------------------------------------------------------------

    def lookup(self, prompt: Sequence[int]) -> Snapshot | None:
        """The snapshot of the longest stored prefix of ``prompt`` (None when nothing matches)."""
        with self._lock:
            lengths = sorted({e.n_tokens for e in self.index.values() if e.n_tokens <= len(prompt)}, reverse=True)
            for n in lengths:
                entry = self.index.get(self.key_for(prompt[:n]))
                if entry is None:
                    continue
                snap = self._load(entry)
                if snap is not None and list(snap.tokens) == list(prompt[:n]):
                    entry.last_used = time.time()
                    os.utime(entry.path)
                    return snap
        return None

    def _load(self, entry: _Entry) -> Snapshot | None:
        try:
            data = entry.path.read_bytes()
            (n,) = _HEADER_LEN.unpack_from(data, len(MAGIC))
            start = len(MAGIC) + _HEADER_LEN.size
            header = json.loads(data[start:start + n])
            payload = data[start + n:]
            if (not data.startswith(MAGIC) or header.get("model_id") != self.model_id
                    or len(payload) != header.get("payload_bytes")
                    or not secrets.compare_digest(self._checksum(payload), str(header.get("blake2b")))):
                raise ValueError("checksum or header mismatch")
            snap = pickle.loads(payload)  # authenticated above with the directory's secret key
            if not isinstance(snap, Snapshot):
                raise ValueError("payload is not a session snapshot")
            return snap
        except Exception as exc:  # any damaged entry is a miss, never a crash
            self._drop(entry.path, f"corrupt cache file ({type(exc).__name__}: {exc})")
            return None

    # ---- save and evict ---------------------------------------------------------------------------------------

    def save(self, snap: Snapshot) -> bool:
        """Store ``snap`` under its tokens; False when skipped (already stored, over budget, or a write error)."""
        key = self.key_for(snap.tokens)
        with self._lock:
            if key in self.index:
                self.index[key].last_used = time.time()
                return False
            payload = pickle.dumps(snap, protocol=pickle.HIGHEST_PROTOCOL)
            header = json.dumps({"version": FORMAT_VERSION, "model_id": self.model_id, "n_tokens": len(snap.tokens),
                                 "payload_bytes": len(payload), "blake2b": self._checksum(payload)}).encode()
            blob = MAGIC + _HEADER_LEN.pack(len(header)) + header + payload
            if len(blob) > self.budget:
                return False
            path = self.dir / f"{key}{_SUFFIX}"
            tmp = self.dir / f"{key}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
            try:
                with self._file_lock():
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    with os.fdopen(fd, "wb") as fh:
                        fh.write(blob)
                        fh.flush()
                        os.fsync(fh.fileno())
                    os.replace(tmp, path)
                    fsync_dir(self.dir)
                    self.index[key] = _Entry(path, len(snap.tokens), len(blob), time.time())
                    self._evict()
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                self.log.warning("KV cache entry not saved; serving continues", error=str(exc))
                return False
            return True

    def _evict(self) -> None:
        total = sum(e.size for e in self.index.values())
        for key, entry in sorted(self.index.items(), key=lambda kv: kv[1].last_used):
            if total <= self.budget:
                break
            entry.path.unlink(missing_ok=True)
            del self.index[key]
            total -= entry.size

    @property
    def used_bytes(self) -> int:
        return sum(e.size for e in self.index.values())


class _FileLock:
    """An exclusive ``flock`` on a lock file, so two servers sharing a directory never interleave writes."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self) -> _FileLock:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def create(directory: str | Path, budget_bytes: int, **options: Any) -> DiskKVStore:
    """The ``disk`` KV store factory (``options``: ``model_id``, the :func:`model_identity` of the model)."""
    return DiskKVStore(directory, budget_bytes, **options)
