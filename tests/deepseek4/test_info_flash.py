"""`ds4 info` on a file with the full-size V4 Flash metadata and tensor table but no tensor data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from ds4_model_deepseek4.config import DeepSeekV4Config
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter

from ds4_core.quants import tensor_nbytes

FLASH = dict(vocab_size=129280, hidden_size=4096, num_layers=43, context_length=1048576, num_heads=64,
             num_kv_heads=1, head_dim=512, value_dim=512, rope_dim=64, q_lora_rank=1024, o_lora_rank=1024,
             o_groups=8, n_experts=256, n_experts_used=6, expert_ffn=2048, n_shared_experts=1, n_hash_layers=3,
             sliding_window=128, index_n_heads=64, index_head_dim=128, index_topk=512, hc_mult=4,
             hc_sinkhorn_iters=20, hc_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0, yarn_factor=16.0,
             yarn_original_context=65536, yarn_beta_fast=32.0, yarn_beta_slow=1.0, routed_scaling_factor=1.5,
             expert_weights_norm=True, rms_norm_eps=1e-6,
             compress_ratios=[0, 0] + [4 if i % 2 == 0 else 128 for i in range(2, 43)], swiglu_limits=[10.0] * 43)


def flash_tensors() -> list[tuple[str, tuple[int, ...], Q]]:
    """(name, numpy shape, type) of the published Q2 recipe (spec §12.3-12.4)."""
    D, V, E = 4096, 129280, 256
    t = [("token_embd.weight", (V, D), Q.F16), ("output.weight", (V, D), Q.Q8_0), ("output_norm.weight", (D,), Q.F32),
         ("output_hc_fn.weight", (4, 4 * D), Q.F16), ("output_hc_base.weight", (4,), Q.F32),
         ("output_hc_scale.weight", (1,), Q.F32)]
    for n in range(43):
        b = f"blk.{n}."
        for sub in ("attn", "ffn"):
            t += [(f"{b}hc_{sub}_fn.weight", (24, 4 * D), Q.F16), (f"{b}hc_{sub}_scale.weight", (3,), Q.F32),
                  (f"{b}hc_{sub}_base.weight", (24,), Q.F32)]
        t += [(f"{b}attn_norm.weight", (D,), Q.F32), (f"{b}ffn_norm.weight", (D,), Q.F32),
              (f"{b}attn_q_a.weight", (1024, D), Q.Q8_0), (f"{b}attn_q_a_norm.weight", (1024,), Q.F32),
              (f"{b}attn_q_b.weight", (32768, 1024), Q.Q8_0), (f"{b}attn_kv.weight", (512, D), Q.Q8_0),
              (f"{b}attn_kv_a_norm.weight", (512,), Q.F32), (f"{b}attn_sinks.weight", (64,), Q.F32),
              (f"{b}attn_output_a.weight", (8192, D), Q.Q8_0), (f"{b}attn_output_b.weight", (D, 8192), Q.Q8_0),
              (f"{b}ffn_gate_inp.weight", (E, D), Q.F16),
              (f"{b}ffn_gate_exps.weight", (E, 2048, D), Q.IQ2_XXS),
              (f"{b}ffn_up_exps.weight", (E, 2048, D), Q.IQ2_XXS),
              (f"{b}ffn_down_exps.weight", (E, D, 2048), Q.Q2_K),
              (f"{b}ffn_gate_shexp.weight", (2048, D), Q.Q8_0), (f"{b}ffn_up_shexp.weight", (2048, D), Q.Q8_0),
              (f"{b}ffn_down_shexp.weight", (D, 2048), Q.Q8_0)]
        t += [(f"{b}ffn_gate_tid2eid.weight", (V, 6), Q.I32)] if n < 3 else [(f"{b}exp_probs_b.bias", (E,), Q.F32)]
        if n >= 2:
            coff, m = (2, 4) if n % 2 == 0 else (1, 128)
            t += [(f"{b}attn_compressor_ape.weight", (m, coff * 512), Q.F16),
                  (f"{b}attn_compressor_kv.weight", (coff * 512, D), Q.F16),
                  (f"{b}attn_compressor_gate.weight", (coff * 512, D), Q.F16),
                  (f"{b}attn_compressor_norm.weight", (512,), Q.F32)]
        if n >= 2 and n % 2 == 0:
            t += [(f"{b}indexer.attn_q_b.weight", (8192, 1024), Q.F16), (f"{b}indexer.proj.weight", (64, D), Q.F16),
                  (f"{b}indexer_compressor_ape.weight", (4, 256), Q.F16),
                  (f"{b}indexer_compressor_kv.weight", (256, D), Q.F16),
                  (f"{b}indexer_compressor_gate.weight", (256, D), Q.F16),
                  (f"{b}indexer_compressor_norm.weight", (128,), Q.F32)]
    return t


def write_flash_headers(path: Path) -> int:
    """Write the full-size Flash metadata and tensor table, without tensor data, to ``path``; return the tensor
    bytes the table declares."""
    writer = GGUFWriter(path, "deepseek4")
    writer.add_name("DeepSeek-V4-Flash")
    for key, (value, vtype, sub) in DeepSeekV4Config(**FLASH).to_gguf_metadata().items():
        writer.add_key_value(key, value, vtype, sub_type=sub)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("joyai-llm")
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    total = 0
    for name, shape, qtype in flash_tensors():
        nbytes = tensor_nbytes(qtype, shape)
        total += nbytes
        writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return total


def test_info_summarises_full_size_flash_metadata_without_tensor_data(tmp_path):
    path = tmp_path / "DeepSeek-V4-Flash-headers.gguf"
    total = write_flash_headers(path)
    assert path.stat().st_size < 2**20  # headers only: ~80 GB of tensor data is absent

    env = {**os.environ}
    proc = subprocess.run([sys.executable, "-m", "ds4_core.cli", "info", "--json", str(path)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["model"]["model"] == "DeepSeek V4 Flash"
    assert info["model"]["layers"].startswith("43: 2 sliding, 21 CSA (m=4), 20 HCA (m=128); 3 hash-routed")
    assert "256 routed (6 active" in info["model"]["experts"] and "IQ2_XXS" in info["model"]["experts"]
    assert info["tensor_bytes"] == total and 75e9 < total < 90e9  # the published Q2 file is ~81 GB
    assert set(info["types"]) == {"F16", "F32", "Q8_0", "IQ2_XXS", "Q2_K", "I32"}
    assert info["parameters"] > 280e9  # Flash: 284B parameters
    assert info["model"]["MTP block"] == "none in this file"  # ds4 ships the Flash MTP block as a separate GGUF
    table = subprocess.run([sys.executable, "-m", "ds4_core.cli", "info", str(path)], capture_output=True,
                           text=True, env=env, timeout=120)
    assert table.returncode == 0 and "DeepSeek V4 Flash" in table.stdout
