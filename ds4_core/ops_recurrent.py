"""Core ops of recurrent (linear-attention) layers: short causal convolution and delta-rule recurrences.

Same conventions as :mod:`ds4_core.ops`; each op's numpy reference is the definition.
"""

from __future__ import annotations

from collections.abc import Callable

RECURRENT_OPS: dict[str, Callable] = {}
