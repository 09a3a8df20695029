"""``ds4 info`` on the shipped tiny GLM 5.3 Flash: decoding-state sizes from spec §7's shapes and the file's own
dimensions (read with gguf-py), per 1K tokens and at the maximum context."""

from __future__ import annotations

import re

from ds4_model_glm5.next_tiny import trained_model
from gguf import GGUFReader

from ds4_core.gguf import GGUFFile
from ds4_core.inspect import file_summary


def exact_bytes(row: str) -> int:
    return int(re.search(r"\(([\d,]+) B\)", row).group(1).replace(",", ""))


def test_info_reports_tiny_glm53_state_as_spec_section_7_sizes_it():
    path = trained_model()
    fields = GGUFReader(path).fields

    def get(key: str):
        return fields[f"glm5-next.{key}"].contents()

    trunk = get("trunk_block_count")
    dsa = [b for b in range(trunk) if get("layer_types")[b] == 1]  # all of them carry an indexer here
    kda = trunk - len(dsa)
    R, dI, P = get("attention.kv_lora_rank"), get("attention.indexer.key_length"), get("attention.indexer.pool_size")
    h, d, K = get("linear_attention.head_count"), get("linear_attention.head_dimension"), get(
        "linear_attention.conv_kernel")
    assert (trunk, len(dsa), R, dI, P, h, d, K) == (6, 3, 128, 32, 4, 4, 64, 4)
    # §7, fp32: DSA latent [T, R] and one pooled indexer key [dI] per complete pool of P tokens, plus the open pool's
    # keys and gate logits; KDA conv history [K−1, 3·h·d] and recurrent state [h, d, d].
    per_1k = 4 * len(dsa) * (1024 * R + 1024 // P * dI)
    fixed = 4 * (len(dsa) * 2 * P * dI + kda * ((K - 1) * 3 * h * d + h * d * d))
    with GGUFFile.open(path, require_data=False) as gguf:
        info = file_summary(gguf)["model"]
    assert exact_bytes(info["state per 1K tokens"]) == per_1k == 1_671_168
    assert exact_bytes(info["state, fixed"]) == fixed
    assert exact_bytes(info["state at 4K (max)"]) == fixed + 4 * per_1k
    assert "KDA recurrent state 192.00 KiB" in info["state, fixed"]
