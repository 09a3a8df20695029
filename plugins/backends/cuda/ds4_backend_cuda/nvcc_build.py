"""The backend's kernel modules built by CUDA's nvcc, which needs no GPU: whether every module builds for an
architecture that no GPU test runs on (``tests/cuda/test_portable_build.py``), and a kernel's machine code
(``benchmarks/sass_loops.py``).

The backend compiles through NVRTC (:mod:`.modules`), which instantiates the template kernels it is asked for by name;
nvcc gets the same text with a line that takes each such kernel's address, which instantiates it.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from collections.abc import Sequence
from pathlib import Path

_SHT_SYMTAB, _STT_FUNC = 2, 2


def nvcc() -> str | None:
    """The path of nvcc: on ``PATH``, else CUDA's default install; None where there is none."""
    found = shutil.which("nvcc")
    default = Path("/usr/local/cuda/bin/nvcc")
    return found or (str(default) if default.exists() else None)


def instances(names: Sequence[str]) -> str:
    """A line that makes nvcc compile each template instance of ``names`` (``extern "C"`` kernels compile as they
    are)."""
    templates = [name for name in names if "<" in name]
    if not templates:
        return ""
    return "static void* ds4_instances[] = {" + ", ".join(f"(void*)&{name}" for name in templates) + "};\n"


def build_cubin(code: str, names: Sequence[str], arch: str, cubin: Path,
                options: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    """Runs nvcc on ``code`` and the :func:`instances` of ``names``, for ``arch`` (``"sm_80"``) into ``cubin`` (the
    source is written beside it); ``options``: more of nvcc's. The finished process: its return code and messages."""
    compiler = nvcc()
    if compiler is None:
        raise FileNotFoundError("no nvcc: install CUDA's compiler (no GPU is needed)")
    source = cubin.with_suffix(".cu")
    source.write_text(code + "\n" + instances(names), encoding="utf-8")
    return subprocess.run([compiler, "-std=c++17", f"-arch={arch}", "-cubin", *options, "-o", str(cubin),
                           str(source)], capture_output=True, text=True)


def functions(cubin: bytes) -> list[str]:
    """The (mangled) names of the functions in an ELF64 cubin's symbol table."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != _SHT_SYMTAB:
            continue
        strtab = sections[link][4]
        for at in range(offset, offset + size, entsize):
            name, info = struct.unpack_from("<IB", cubin, at)
            if info & 0xF == _STT_FUNC:
                names.append(cubin[strtab + name:cubin.index(b"\0", strtab + name)].decode())
    return names


def matches(kernel: str, mangled: str) -> bool:
    """Whether the mangled name is the kernel's: ``"gemv<Q8_0, 8>"`` that instance (format structs and int arguments,
    as the Itanium ABI mangles them), a plain name the ``extern "C"`` kernel or every instance of the template."""
    name, _, arguments = kernel.partition("<")
    prefix = f"_Z{len(name)}{name}I"
    if not arguments:
        return mangled == name or mangled.startswith(prefix)
    for argument in arguments.rstrip(">").split(","):
        argument = argument.strip()
        prefix += f"Li{argument}E" if argument.lstrip("-").isdigit() else f"{len(argument)}{argument}"
    return mangled.startswith(prefix + "E")
