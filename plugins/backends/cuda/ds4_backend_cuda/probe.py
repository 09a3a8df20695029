"""Availability check that never initialises CUDA in the calling process."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from typing import Any

# Runs in a child process: CUDA initialised there cannot disturb a parent that later forks or picks another device.
_QUERY = """
import json, cupy
n = cupy.cuda.runtime.getDeviceCount()
p = cupy.cuda.runtime.getDeviceProperties(0) if n else {}
print(json.dumps({"count": n, "name": p.get("name", b"").decode(errors="replace"),
                  "cc": [p.get("major", 0), p.get("minor", 0)], "cupy": cupy.__version__}))
"""

#: Oldest compute capability the kernels build for: the prefill's tiles use ``cp.async`` and bf16 ``mma.sync``
#: (sm_80), which ``tests/cuda/test_portable_build.py`` builds every module for.
MIN_COMPUTE_CAPABILITY = (8, 0)


def probe(timeout: float = 60.0) -> tuple[bool, str]:
    """(usable, reason): CuPy importable and a CUDA device of compute capability ≥ 8.0 as device 0."""
    if importlib.util.find_spec("cupy") is None:
        return False, "CuPy is not installed; pip install cupy-cuda12x (or cupy-cuda13x) to use the CUDA backend"
    try:
        done = subprocess.run([sys.executable, "-c", _QUERY], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"querying the CUDA device took longer than {timeout:.0f} s; check the driver with nvidia-smi"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["unknown error"])[-1]
        return False, f"CuPy could not reach a CUDA device: {last}"
    return device_verdict(json.loads(done.stdout.strip().splitlines()[-1]))


def device_verdict(info: dict[str, Any]) -> tuple[bool, str]:
    """(usable, reason) for the child's answer: ``count``, and device 0's ``name``, ``cc`` and the ``cupy`` version."""
    if info["count"] < 1:
        return False, "no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the driver)"
    cc = tuple(info["cc"])
    if cc < MIN_COMPUTE_CAPABILITY:
        need = ".".join(map(str, MIN_COMPUTE_CAPABILITY))
        return False, (f"{info['name']} has compute capability {cc[0]}.{cc[1]}; the CUDA backend needs {need} or "
                       "newer (Ampere and later)")
    return True, f"{info['name']} (compute capability {cc[0]}.{cc[1]}), CuPy {info['cupy']}"
