#!/usr/bin/env bash
# Train the three tiny models at once on one GPU (one background process each: the models are too small to keep
# the GPU busy alone), then pack them (float16 weights, gzip) into OUT as 15 MB parts of models.tar.gz.
# Usage: tools/train_tiny/train_all.sh DATA OUT   (DATA: prepare.py's --out; minutes via DS4_MIN / OTHER_MIN)
# Unpack: cat OUT/models.tar.gz.part-* | tar -xz
# python3 needs transformers >= 5.23 (older ones lack these models' current layer types); install a wheel with
# `python3 -m pip install`: a bare `pip` may belong to another interpreter.
set -u
data=$1 out=$2
python3 -c 'import sys, transformers as t; v = tuple(map(int, t.__version__.split(".")[:2]));
sys.exit(v < (5, 23) and f"transformers {t.__version__} in {sys.executable} is too old; need >= 5.23")' || exit 1
work=$(mktemp -d)
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
train() {  # family batch minutes
  python3 tools/train_tiny/train.py --family "$1" --data "$data" --out "$work/$1" --batch "$2" --minutes "$3" \
    --save-dtype float16 >"$out/$1.log" 2>&1
  echo "$1 exited with $?" >>"$out/$1.log"
}
train deepseek4 128 "${DS4_MIN:-6.5}" &
train glm53 64 "${OTHER_MIN:-6}" &
train qwen38 64 "${OTHER_MIN:-6}" &
wait
tar -C "$work" -cf - . | gzip -1 | split -b 15M - "$out/models.tar.gz.part-"
ls -l "$out"
