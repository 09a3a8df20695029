#!/usr/bin/env bash
# Train tiny models at once on one GPU (one background process each: the models are too small to keep the GPU busy
# alone), then convert each to a Q8_0 GGUF in OUT with its loss.json (`ds4 convert`, so ds4-core and the model
# plugins must be installed) and pack the logs and loss files into OUT/logs.tar.gz.
# Usage: tools/train_tiny/train_all.sh DATA OUT [JOB ...]   (DATA: prepare.py's --out)
#   JOB = NAME:FAMILY:BATCH:MINUTES[:CONFIG_JSON]; default: the three shipped recipes. MTP=1 adds --mtp to every job
#   and TRAIN_ARGS (e.g. '--final-windows 128') is passed to every train.py.
# python3 needs transformers >= 5.23 (older ones lack these models' current layer types); install a wheel with
# `python3 -m pip install`: a bare `pip` may belong to another interpreter.
set -u
data=$1 out=$2
shift 2
[ $# -gt 0 ] || set -- deepseek4:deepseek4:128:6.5 glm53:glm53:64:6.5 qwen38:qwen38:64:6.5
python3 -c 'import sys, transformers as t; v = tuple(map(int, t.__version__.split(".")[:2]));
sys.exit(v < (5, 23) and f"transformers {t.__version__} in {sys.executable} is too old; need >= 5.23")' || exit 1
work=$(mktemp -d)
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
train() {  # NAME FAMILY BATCH MINUTES [CONFIG_JSON]
  python3 tools/train_tiny/train.py --family "$2" --data "$data" --out "$work/$1" --batch "$3" --minutes "$4" \
    --config "${5:-{\}}" --save-dtype float16 ${MTP:+--mtp} ${TRAIN_ARGS:-} >"$work/$1.log" 2>&1 &&
    ds4 convert "$work/$1/model" "$out/$1.gguf" --outtype q8_0 >>"$work/$1.log" 2>&1
  echo "$1 exited with $?" >>"$work/$1.log"
}
for job in "$@"; do
  IFS=: read -r name family batch minutes config <<<"$job"
  train "$name" "$family" "$batch" "$minutes" "$config" &
done
wait
(cd "$work" && tar -czf "$out/logs.tar.gz" ./*.log ./*/loss.json)
tail -n 3 "$work"/*.log
ls -l "$out"
