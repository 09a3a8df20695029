"""The backend's self-test for ``ds4 backends --self-test``: each custom Metal kernel against its MLX-op path."""

from __future__ import annotations


def self_test() -> list[dict[str, str]]:
    """One row per custom kernel (``check``, ``status``, ``detail``); failing kernels stay disabled."""
    from .kernels import verify_and_enable

    return [{"check": r.name, "status": r.status, "detail": r.detail} for r in verify_and_enable()]
