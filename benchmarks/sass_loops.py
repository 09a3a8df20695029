"""A CUDA kernel's loops in its machine code (SASS), without a GPU: each loop's instructions, by opcode.

Compiles the kernel's module for sm_90 with nvcc from the text the backend compiles (``modules.program``: the shared
headers, then the sources named), with the template instance asked for, disassembles it with ``cuobjdump`` (CUDA's,
or the copy that Triton's wheel carries under ``triton/backends/nvidia/bin``), and lists every loop (a backward
branch and its target) of the functions named like the kernel: addresses, instructions a pass, the commonest
opcodes; then ptxas's registers, spills and shared memory. An issue-bound loop's time follows what it issues a pass,
and the listing shows what the compiler added: in session 53, 57 of the routed gate/up loop's 594 instructions copied
a literal into a register before each ``prmt``.

Usage: python benchmarks/sass_loops.py 'moe_gate_up_i8<IQ2_XXS>' [--sources quant.cu quant_int8.cu] [--top 12]
       [--cuobjdump PATH]
(needs nvcc and a cuobjdump; no GPU.)
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

from ds4_backend_cuda.modules import program
from ds4_backend_cuda.nvcc_build import build_cubin, matches, nvcc

#: One instruction line of ``cuobjdump -sass``: its address, then the instruction up to the ``;``.
_INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
_BACKWARD = re.compile(r"\bBRA\s+(?:`\(\S+\)\s*)?0x([0-9a-f]+)")


def opcode(instruction: str) -> str:
    """The mnemonic of a SASS instruction without its predicate and modifiers: ``@!P0 LDG.E.128 R4, [R2]`` ->
    ``LDG``."""
    words = instruction.split()
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """The (address, instruction) lists of each function in ``cuobjdump -sass`` output, by mangled name."""
    out: dict[str, list[tuple[int, str]]] = {}
    current: list[tuple[int, str]] | None = None
    for line in sass.splitlines():
        if m := _FUNCTION.match(line):
            current = out.setdefault(m.group(1), [])
        elif current is not None and (m := _INSTRUCTION.match(line)):
            current.append((int(m.group(1), 16), m.group(2)))
    return out


def loops(code: list[tuple[int, str]]) -> list[tuple[int, int, list[str]]]:
    """Every loop of a function: (first address, address of the branch back, its instructions), for each branch
    whose target lies at or before it, innermost (shortest) first."""
    found = []
    for address, instruction in code:
        m = _BACKWARD.search(instruction)
        if m and int(m.group(1), 16) <= address:
            start = int(m.group(1), 16)
            found.append((start, address, [i for a, i in code if start <= a <= address]))
    return sorted(found, key=lambda loop: loop[1] - loop[0])


def _cuobjdump(given: str | None) -> str:
    if given:
        return given
    if found := shutil.which("cuobjdump"):
        return found
    spec = importlib.util.find_spec("triton")
    if spec and spec.origin:
        carried = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if carried.exists():
            return str(carried)
    raise SystemExit("no cuobjdump: install CUDA's, or Triton (pip install triton), or give --cuobjdump PATH")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kernel", help="a kernel's name, or a template instance such as 'gemv_i8<Q8_0>'")
    parser.add_argument("--sources", nargs="+", default=["quant.cu", "quant_int8.cu"],
                        help="the module's sources in kernels/, after the shared headers (default: the quant module)")
    parser.add_argument("--top", type=int, default=12, help="opcodes listed a loop")
    parser.add_argument("--cuobjdump", help="path of cuobjdump (default: on PATH, else Triton's copy)")
    args = parser.parse_args()
    if nvcc() is None:
        raise SystemExit("no nvcc on PATH: this needs CUDA's compiler (no GPU)")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "module.cubin"
        built = build_cubin(program(*args.sources), [args.kernel], "sm_90", cubin, ("-Xptxas", "-v"))
        if built.returncode:
            raise SystemExit(f"nvcc failed:\n{built.stderr.strip()}")
        sass = subprocess.run([_cuobjdump(args.cuobjdump), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    report = built.stderr.splitlines()
    shown = 0
    for name, code in functions(sass).items():
        if not matches(args.kernel, name):
            continue
        shown += 1
        print(f"{name}: {len(code)} instructions")
        for i, line in enumerate(report):
            if "Compiling entry" in line and name in line:
                print("  " + "; ".join(r.split(":", 1)[-1].strip() for r in report[i + 2:i + 4]))
        for start, end, body in loops(code):
            common = Counter(opcode(i) for i in body).most_common(args.top)
            print(f"  loop {start:#06x}-{end:#06x}: {len(body)} instructions a pass; "
                  + ", ".join(f"{op} {n}" for op, n in common))
    if not shown:
        raise SystemExit(f"no function named like {args.kernel} in the module built from {' '.join(args.sources)}")


if __name__ == "__main__":
    main()
