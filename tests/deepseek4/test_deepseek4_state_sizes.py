"""Decoding-state sizes of DeepSeek V4 Flash against spec §9.1, as ``ds4 info`` reports them, and ``Engine.load``
refusing a context whose state does not fit in memory."""

from __future__ import annotations

import re
import shutil

import attrs
import numpy as np
import pytest
from ds4_model_deepseek4.config import DeepSeekV4Config
from ds4_model_deepseek4.state import new_state, state_breakdown, state_nbytes
from gguf import GGUFReader
from test_info_flash import FLASH, write_flash_headers

from ds4_core.backends.numpy import NumpyBackend
from ds4_core.engine import Engine
from ds4_core.errors import ContextError
from ds4_core.gguf import GGUFFile
from ds4_core.inspect import file_summary

# Spec §1.1/§1.2/§9.1, Flash: window W = 128, head_dim 512, indexer head_dim 128; 2 sliding, 21 CSA (m = 4) and
# 20 HCA (m = 128) layers. §9.1 gives each state as "float" rows: 4 bytes an element.
F32, W, HD, IH, N_SLIDING, N_CSA, N_HCA = 4, 128, 512, 128, 2, 21, 20


def spec_flash_state(ctx: int) -> dict[str, int]:
    """Spec §9.1's per-layer state sizes summed over the Flash layer schedule, by kind."""
    csa_frontier = 4 * (1024 + 1024) + 4 * (512 + 512) + 4 * (256 + 256) + 4 * (128 + 128)  # buffers + Ca halves
    return {"raw window KV ring": F32 * (N_SLIDING + N_CSA + N_HCA) * W * HD,
            "CSA compressed KV rows": F32 * N_CSA * (ctx // 4) * HD,
            "HCA compressed KV rows": F32 * N_HCA * (ctx // 128) * HD,
            "indexer keys": F32 * N_CSA * (ctx // 4) * IH,
            "compressor frontier": F32 * (N_HCA * 128 * (512 + 512) + N_CSA * csa_frontier)}


def exact_bytes(row: str) -> int:
    """The exact byte count ``ds4 info`` prints in a state row ("13.44 MiB (14,090,240 B): ...")."""
    match = re.search(r"\(([\d,]+) B\)", row)
    assert match, row
    return int(match.group(1).replace(",", ""))


@pytest.fixture(scope="module")
def flash_info(tmp_path_factory) -> dict[str, str]:
    path = tmp_path_factory.mktemp("flash") / "DeepSeek-V4-Flash-headers.gguf"
    write_flash_headers(path)
    with GGUFFile.open(path, require_data=False) as gguf:
        return file_summary(gguf)["model"]


def test_info_reports_flash_state_per_1k_tokens_and_per_context_as_in_the_spec(flash_info):
    per_1k = sum(spec_flash_state(1024).values()) - sum(spec_flash_state(0).values())
    assert exact_bytes(flash_info["state per 1K tokens"]) == per_1k == 14_090_240  # 13.44 MiB
    assert exact_bytes(flash_info["state, fixed"]) == sum(spec_flash_state(0).values())
    for label, ctx in (("4K", 4096), ("32K", 32768), ("128K", 131072), ("1M (max)", 1048576)):
        assert exact_bytes(flash_info[f"state at {label}"]) == sum(spec_flash_state(ctx).values()), label


@pytest.mark.parametrize("ctx", [0, 1, 127, 1024, 4099, 1048576])
def test_flash_state_breakdown_matches_the_spec_kind_by_kind(ctx):
    cfg = DeepSeekV4Config(**FLASH)
    assert state_breakdown(cfg, ctx) == spec_flash_state(ctx)
    assert state_nbytes(cfg, ctx) == sum(spec_flash_state(ctx).values())


def test_flash_state_breakdown_counts_what_new_state_allocates():
    cfg, ctx = DeepSeekV4Config(**FLASH), 2048
    state = new_state(cfg, ctx, np)
    arrays = [a for layer in state.layers for part in (layer, layer.compressor, layer.indexer) if part is not None
              for a in attrs.asdict(part, recurse=False).values() if isinstance(a, np.ndarray)]
    allocated = [a for a in arrays if a.base is None]  # the raw ring and compressed rows are views of a layer's keys
    assert all(any(np.shares_memory(a, b) for b in allocated) for a in arrays)
    assert sum(a.nbytes for a in allocated) == state_nbytes(cfg, ctx)


def _with_context_length(src, dst, value: int) -> None:
    """Copy ``src`` to ``dst`` with ``deepseek4.context_length`` (a fixed-width UINT32) set to ``value``."""
    shutil.copyfile(src, dst)
    field = GGUFReader(dst, "r+").fields["deepseek4.context_length"]
    field.parts[field.data[0]][0] = value  # the reader's arrays map the file: this writes it
    del field


def test_engine_load_refuses_a_context_larger_than_memory_with_both_numbers(tmp_path):
    from ds4_model_deepseek4.tiny import ensure_default_model

    path = tmp_path / "tiny-4G-context.gguf"
    _with_context_length(ensure_default_model(tmp_path / "cache"), path, 2**32 - 1)
    assert GGUFReader(path).fields["deepseek4.context_length"].contents() == 2**32 - 1
    with GGUFFile.open(path, require_data=False) as gguf:
        need = state_nbytes(DeepSeekV4Config.from_metadata(gguf.metadata), 2**32 - 1)
    free = NumpyBackend().free_memory()
    if free is None or free >= need:
        pytest.skip(f"this machine reports {free} bytes free, not less than the {need} the context needs")
    with pytest.raises(ContextError) as err:
        Engine.load(path, backend="numpy", ctx=2**32 - 1)
    message = str(err.value)
    needed, available = (float(x) for x in re.findall(r"([\d.]+) GiB", message))
    assert needed == round(need / 2**30, 2) and available < 2 * needed and "--ctx" in message
