"""Synthetic DeepSeek V4 Flash benchmark on the CUDA backend (same measurements as ``ds4 bench``).

Usage: python benchmarks/synthetic_deepseek4.py [--recipe q2 q4 ...] [--layers N] [--out results.json]
Prints the table of each recipe and writes all results as JSON.
"""

from __future__ import annotations

import argparse
import json

from ds4_bench.synthetic_deepseek4 import MODEL
from ds4_bench.synthetic_run import print_report, run_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", nargs="+", default=["q2"], choices=["q2", "q4", "mxfp4"])
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None, help="write the results here as JSON")
    args = parser.parse_args()
    results = []
    for recipe in args.recipe:
        r = run_model(MODEL, recipe, args.layers, args.repeats)
        print_report(r)
        results.append(r)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
