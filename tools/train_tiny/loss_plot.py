"""The loss-curve figure both training scripts draw: per-step loss, its moving mean, then their own extra lines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def loss_axes(loss: list[float], window: int, what: str) -> tuple[Any, Any]:
    """(figure, axes) holding ``loss`` per step and its ``window``-step mean, labelled ``what``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loss_arr = np.asarray(loss)
    smooth = np.convolve(loss_arr, np.ones(window) / window, mode="valid")
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(loss_arr, color="tab:blue", alpha=0.25, lw=0.8, label=f"{what} (per step)")
    ax.plot(np.arange(window - 1, window - 1 + smooth.size), smooth, color="tab:blue",
            label=f"{what} ({window}-step mean)")
    return fig, ax


def save(fig: Any, ax: Any, *, xlabel: str, ylabel: str, title: str, top: float, path: Path) -> None:
    """Label the axes, add the legend and write the figure to ``path``."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.set_ylim(0, top)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
