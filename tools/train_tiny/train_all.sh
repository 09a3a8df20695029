#!/usr/bin/env bash
# Train the three tiny models at once on one GPU (one background process each: the models are too small to keep
# the GPU busy alone), then pack them (float16 weights, gzip) into OUT as 15 MB parts of models.tar.gz.
# Usage: tools/train_tiny/train_all.sh DATA OUT   (DATA: prepare.py's --out; minutes via DS4_MIN / OTHER_MIN)
# Unpack: cat OUT/models.tar.gz.part-* | tar -xz
set -u
data=$1 out=$2
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
