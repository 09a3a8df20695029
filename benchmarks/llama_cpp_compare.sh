#!/usr/bin/env bash
# llama.cpp (CUDA) next to ds4-core on the same synthetic DeepSeek V4 Flash GGUFs (issue #4).
#
# Usage (on the GPU machine, from the repository root):
#   benchmarks/llama_cpp_compare.sh TARBALL OUT_DIR [STEP ...]
# TARBALL: a llama.cpp source tree with the deepseek4 architecture (tested: upstream 88bfee142), as .tar/.tar.xz/.tar.gz
#          with one top-level folder. It is not part of this repository: carry it as an ignored path.
# STEPS:   build models bench report (default: all four, in this order).
#
# Every step skips what is already done (in $WORK), so a run stopped by the 10-minute command limit is finished by
# running the same command again: the CUDA build usually needs two calls. No step starts a task once DEADLINE_S
# seconds have passed, and each task is cut at that deadline (exit 3 = "not finished, run me again").
# The build is CPU-bound and writing the files is one Python process, so the first call can overlap them:
#   S=benchmarks/llama_cpp_compare.sh; $S T $OUT models > $OUT/models.out 2>&1 & $S T $OUT build; wait
#
# What it measures, for Flash-shaped Q2 files of each LAYERS count (default 4 and 12):
#   llama.cpp: llama-bench -ngl 99 -fa 1 -b/-ub PROMPT (one load per file): prefill of PROMPT tokens and decode of
#              GEN tokens, on an empty cache and after each of DEPTHS cached tokens (all in the saved jsonl);
#   ds4-core:  ds4 bench -m FILE --prompt-tokens D --decode-tokens GEN for D in DEPTHS (prefill of D tokens, then
#              GEN greedy decode steps after them; graph replay and eager).
# The report gives both engines per file and the per-layer cost (T_big - T_small) / (big - small layers), which
# cancels the embedding, head and per-step overheads that do not grow with the layer count.
#
# Environment (defaults): WORK=/tmp/llama_cmp (source, build, GGUFs, results; ~35 GB for 4+12 layers),
#   LAYERS="4 12", PROMPT=2048, GEN=64, DEPTHS="2048 32768", REPEATS=3, JOBS=$(nproc), DEADLINE_S=560,
#   TASK_S=420 (a task that fails or runs this long is marked $WORK/results/NAME.failed and not retried until that
#   file is deleted), DS4=ds4,
#   DS4_BACKEND=cuda, DS4_LONG_ENV="DS4_CUDA_PREFILL=16" (extra environment for ds4 runs with D > 8192, as in
#   docs/performance.md), LLAMA_BUILD=$WORK/build (a folder with bin/llama-bench skips the build step),
#   CUDA_ARCH=90, GGML_CUDA=ON (OFF: a CPU build, for a dry run without a GPU).
# ds4 must be importable there, e.g. (docs/performance.md) python3 -m pip install --no-index --no-deps
#   --no-build-isolation --target /tmp/site . plugins/backends/cuda plugins/frontends/bench plugins/models/deepseek4
#   and PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH.
set -u -o pipefail

if [ $# -lt 2 ]; then
    sed -n '2,/^set -u/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'
    exit 2
fi
TARBALL=$1
OUT_DIR=$2
shift 2
STEPS=${*:-build models bench report}

WORK=${WORK:-/tmp/llama_cmp}
LAYERS=${LAYERS:-4 12}
PROMPT=${PROMPT:-2048}
GEN=${GEN:-64}
DEPTHS=${DEPTHS:-2048 32768}
REPEATS=${REPEATS:-3}
JOBS=${JOBS:-$(nproc)}
DEADLINE_S=${DEADLINE_S:-560}
TASK_S=${TASK_S:-420}
DS4=${DS4:-ds4}
DS4_BACKEND=${DS4_BACKEND:-cuda}
DS4_LONG_ENV=${DS4_LONG_ENV:-DS4_CUDA_PREFILL=16}
LLAMA_BUILD=${LLAMA_BUILD:-$WORK/build}
CUDA_ARCH=${CUDA_ARCH:-90}
GGML_CUDA=${GGML_CUDA:-ON}
RESULTS=$WORK/results
mkdir -p "$WORK" "$RESULTS" "$OUT_DIR"
LOG=$OUT_DIR/llama_cpp_compare.log

say() { echo "[$(date +%H:%M:%S) +${SECONDS}s] $*" | tee -a "$LOG"; }
left() { echo $((DEADLINE_S - SECONDS)); }

# run_task NAME RESULT_FILE CMD...: runs CMD (stdout -> RESULT_FILE, stderr -> $OUT_DIR/NAME.log) unless
# RESULT_FILE or NAME.failed exists. Cut by the deadline: exit 3 (rerun). Failed or over TASK_S: NAME.failed.
run_task() {
    local name=$1 result=$2
    shift 2
    if [ -s "$result" ]; then return 0; fi
    if [ -e "$RESULTS/$name.failed" ]; then say "skip $name (failed before: $(cat "$RESULTS/$name.failed"))"; return 0; fi
    local budget
    budget=$(left)
    if [ "$budget" -lt 30 ]; then say "out of time before $name: run the same command again"; exit 3; fi
    local limit=$TASK_S cut_by_deadline=0
    if [ "$budget" -lt "$limit" ]; then limit=$budget; cut_by_deadline=1; fi
    say "start $name (limit ${limit}s): $*"
    local rc=0
    timeout "$limit" "$@" > "$result.tmp" 2> "$OUT_DIR/$name.log" || rc=$?
    if [ $rc -eq 0 ]; then
        mv "$result.tmp" "$result"
        say "done $name"
        return 0
    fi
    if [ $rc -eq 124 ] && [ $cut_by_deadline -eq 1 ]; then
        rm -f "$result.tmp"
        say "$name cut by the deadline: run the same command again"
        exit 3
    fi
    # Keep what a failed run printed (llama-bench writes one jsonl line per finished test).
    if [ -s "$result.tmp" ]; then mv "$result.tmp" "$result"; else rm -f "$result.tmp"; fi
    echo "rc=$rc (limit ${limit}s); log: $name.log" > "$RESULTS/$name.failed"
    say "FAILED $name (rc=$rc); last lines of its log:"
    tail -n 15 "$OUT_DIR/$name.log" | tee -a "$LOG"
}

step_build() {
    if [ -x "$LLAMA_BUILD/bin/llama-bench" ]; then say "llama-bench already built in $LLAMA_BUILD"; return; fi
    local src=$WORK/src
    if [ ! -f "$src/CMakeLists.txt" ]; then
        [ -f "$TARBALL" ] || { say "no source tarball at $TARBALL"; exit 2; }
        rm -rf "$src" && mkdir -p "$src"
        tar -xf "$TARBALL" -C "$src" --strip-components=1 || { say "cannot unpack $TARBALL"; exit 2; }
    fi
    for tool in cmake ninja; do command -v $tool > /dev/null || { say "$tool is missing (pip wheel: cmake/ninja)"; exit 2; }; done
    if [ ! -f "$LLAMA_BUILD/build.ninja" ]; then
        say "configure llama.cpp (GGML_CUDA=$GGML_CUDA, sm_$CUDA_ARCH) in $LLAMA_BUILD"
        # FA on: the DeepSeek V4 path is benchmarked with -fa 1. Everything that would download is off.
        cmake -S "$src" -B "$LLAMA_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_CCACHE=OFF \
            -DGGML_CUDA="$GGML_CUDA" -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH" -DGGML_CUDA_FA=ON \
            -DGGML_CUDA_FA_ALL_QUANTS=OFF -DGGML_CUDA_NCCL=OFF -DGGML_CUDA_GRAPHS=ON -DGGML_OPENMP=ON \
            -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
            -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
            -DLLAMA_LLGUIDANCE=OFF > "$OUT_DIR/cmake-configure.log" 2>&1 \
            || { rm -f "$LLAMA_BUILD/build.ninja"; say "configure failed:"; tail -n 30 "$OUT_DIR/cmake-configure.log"; exit 1; }
    fi
    local budget rc=0
    budget=$(left)
    say "build llama-bench with -j $JOBS for at most ${budget}s (resumes where the last call stopped)"
    timeout "$budget" cmake --build "$LLAMA_BUILD" --target llama-bench -j "$JOBS" >> "$OUT_DIR/build.log" 2>&1 || rc=$?
    if [ $rc -eq 124 ]; then
        say "build not finished ($(grep -o '^\[[0-9]*/[0-9]*\]' "$OUT_DIR/build.log" | tail -n 1)): run the same command again"
        exit 3
    elif [ $rc -ne 0 ]; then
        say "build failed (rc=$rc):"; grep -B2 -A8 -m3 'error' "$OUT_DIR/build.log" | tee -a "$LOG"; exit 1
    fi
    say "built $LLAMA_BUILD/bin/llama-bench"
}

model_path() { echo "$WORK/flash-q2-${1}L.gguf"; }

step_models() {
    for n in $LAYERS; do
        local f
        f=$(model_path "$n")
        if [ -f "$f" ]; then say "have $f"; continue; fi
        local budget
        budget=$(left)
        if [ "$budget" -lt 60 ]; then say "out of time before writing $f: run the same command again"; exit 3; fi
        say "write $f (--layers $n, recipe q2)"
        # The writer renames FILE.partial to FILE only when complete, so a cut run leaves no half file.
        timeout "$budget" $DS4 bench --synthetic deepseek4-flash --recipe q2 --layers "$n" --write-gguf "$f" \
            >> "$OUT_DIR/write-gguf.log" 2>&1 || { say "writing $f stopped (rc=$?): see write-gguf.log; run again"; exit 3; }
        say "wrote $f ($(du -h "$f" | cut -f1))"
    done
}

step_bench() {
    local bench=$LLAMA_BUILD/bin/llama-bench
    [ -x "$bench" ] || { say "no $bench: run the build step first"; exit 2; }
    "$bench" --list-devices > "$OUT_DIR/llama-devices.txt" 2>&1 || true
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT_DIR/gpu.txt" 2>&1 || true
    local depths_csv=${DEPTHS// /,}
    for n in $LAYERS; do
        local f
        f=$(model_path "$n")
        [ -f "$f" ] || { say "no $f: run the models step first"; exit 2; }
        # One load: prefill of PROMPT and decode of GEN tokens, each on an empty cache and after every depth.
        run_task "llama-${n}L" "$RESULTS/llama-${n}L.jsonl" "$bench" -m "$f" -ngl 99 -fa 1 -b "$PROMPT" \
            -ub "$PROMPT" -p "$PROMPT" -n "$GEN" -d "0,$depths_csv" -r "$REPEATS" -o jsonl
        for d in $DEPTHS; do
            local extra=()
            if [ "$d" -gt 8192 ]; then read -r -a extra <<< "$DS4_LONG_ENV"; fi
            run_task "ds4-${n}L-d${d}" "$RESULTS/ds4-${n}L-d${d}.json" env "${extra[@]}" $DS4 bench -m "$f" \
                --backend "$DS4_BACKEND" --prompt-tokens "$d" --decode-tokens "$GEN" --json
        done
    done
}

step_report() {
    cp -f "$RESULTS"/* "$OUT_DIR"/ 2>/dev/null || true
    python3 - "$RESULTS" "$PROMPT" "$GEN" "$LAYERS" "$DEPTHS" "$DS4_LONG_ENV" <<'PY' | tee "$OUT_DIR/report.txt"
import json, sys
from pathlib import Path

results, prompt, gen = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
layers, depths, long_env = [int(x) for x in sys.argv[4].split()], [int(x) for x in sys.argv[5].split()], sys.argv[6]


def jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def ms(rows, n_prompt, n_gen, depth):
    """llama-bench: milliseconds per test (prefill) or per generated token (decode)."""
    for r in rows:
        if (r["n_prompt"], r["n_gen"], r.get("n_depth", 0)) == (n_prompt, n_gen, depth):
            return r["avg_ns"] / 1e6 / max(n_gen, 1)
    return None


def ds4(n, d):
    path = results / f"ds4-{n}L-d{d}.json"
    return json.loads(path.read_text()) if path.exists() else None


rows = {}  # (quantity, engine) -> {layers: ms}
for n in layers:
    tests = jsonl(results / f"llama-{n}L.jsonl")
    rows.setdefault((f"prefill {prompt} tok, ms", "llama.cpp"), {})[n] = ms(tests, prompt, 0, 0)
    r = ds4(n, prompt)
    rows.setdefault((f"prefill {prompt} tok, ms", "ds4-core"), {})[n] = 1e3 * prompt / r["prefill_tokens_per_s"] if r else None
    for d in depths:
        key = f"decode @{d}, ms/tok"
        rows.setdefault((key, "llama.cpp"), {})[n] = ms(tests, 0, gen, d)
        r = ds4(n, d)
        for mode, label in (("graph_decode_tokens_per_s", "ds4-core graph"), ("eager_decode_tokens_per_s", "ds4-core eager")):
            rows.setdefault((key, label), {})[n] = 1e3 / r[mode] if r and r.get(mode) else None


def fmt(v):
    return f"{v:10.3f}" if v is not None else f"{'-':>10}"


lo, hi = min(layers), max(layers)
head = f"{'quantity':<26}{'engine':<16}" + "".join(f"{f'{n} layers':>10}" for n in layers)
head += f"{'per layer':>10}{'43 layers':>10}"
print(head)
print("-" * len(head))
for (quantity, engine), by_n in rows.items():
    slope = (by_n[hi] - by_n[lo]) / (hi - lo) if hi > lo and by_n.get(hi) is not None and by_n.get(lo) is not None else None
    whole = by_n[lo] + (43 - lo) * slope if slope is not None else None
    print(f"{quantity:<26}{engine:<16}" + "".join(fmt(by_n.get(n)) for n in layers) + fmt(slope) + fmt(whole))
print(f"\nper layer = (T{hi} - T{lo}) / {hi - lo}; 43 layers = T{lo} + {43 - lo} x per layer (a projection).")
print(f"llama.cpp: llama-bench -ngl 99 -fa 1 -b/-ub {prompt}; prefill on an empty cache, decode of {gen} tokens after "
      f"the depth. ds4-core: ds4 bench -m, prefill of D tokens then {gen} decode steps (D > 8192 with {long_env}).")
PY
}

say "steps: $STEPS; WORK=$WORK; layers: $LAYERS"
for step in $STEPS; do
    case $step in
        build) step_build ;;
        models) step_models ;;
        bench) step_bench ;;
        report) step_report ;;
        *) say "unknown step $step (build, models, bench, report)"; exit 2 ;;
    esac
done
