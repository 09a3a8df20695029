"""``ds4 info`` on the shipped tiny Qwen3.8: decoding-state sizes from spec §5's shapes and the file's own
dimensions (read with gguf-py), per 1K tokens and at the maximum context."""

from __future__ import annotations

import re

from ds4_model_qwen38.tiny import trained_model
from gguf import GGUFReader

from ds4_core.gguf import GGUFFile
from ds4_core.inspect import file_summary


def exact_bytes(row: str) -> int:
    return int(re.search(r"\(([\d,]+) B\)", row).group(1).replace(",", ""))


def test_info_reports_tiny_qwen38_state_as_spec_section_5_sizes_it():
    path = trained_model()
    fields = GGUFReader(path).fields

    def get(key: str):
        return fields[f"qwen4exp.{key}"].contents()

    # The trunk's layers only: the MTP block stored after them keeps its own drafter state.
    ratios = get("attention.compress_ratios")[:get("block_count") - get("nextn_predict_layers")]
    attention = sum(r > 0 for r in ratios)
    delta = len(ratios) - attention
    hkv, hd, di = get("attention.head_count_kv"), get("attention.key_length"), get("attention.indexer.key_length")
    nk, dk, nv, inner, K = (get("ssm.group_count"), get("ssm.state_size"), get("ssm.time_step_rank"),
                            get("ssm.inner_size"), get("ssm.conv_kernel"))
    ple, n, K_ple, hc, D = (len(get("ple.layers")), get("ple.ngram_size"), get("ple.conv_kernel"),
                            get("hyper_connection.count"), get("embedding_length"))
    dv = inner // nv
    assert (attention, delta, hkv, hd, di, nk, dk, nv, dv, ple, n) == (3, 3, 1, 64, 32, 2, 64, 4, 64, 3, 3)
    # §5, fp32: attention K and V [T, Hkv, hd] and indexer keys [T, di]; delta-net conv history of K−1 qkv rows
    # (2·nk·dk + nv·dv wide) and state [nv, dk, dv]; PLE conv history (K_ple−1)·n rows × hc·D.
    per_1k = 4 * attention * 1024 * (2 * hkv * hd + di)
    fixed = 4 * (delta * ((K - 1) * (2 * nk * dk + nv * dv) + nv * dk * dv) + ple * (K_ple - 1) * n * hc * D)
    with GGUFFile.open(path, require_data=False) as gguf:
        info = file_summary(gguf)["model"]
    assert exact_bytes(info["state per 1K tokens"]) == per_1k == 1_966_080
    assert exact_bytes(info["state, fixed"]) == fixed
    assert exact_bytes(info["state at 4K (max)"]) == fixed + 4 * per_1k
