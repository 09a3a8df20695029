"""Synthetic models for ``ds4 bench`` as plain data: the *weight plan* of one decode token (every matrix a batch-1
token reads, in launch order), the *state reads* that grow with the context, and the prefill matmuls both imply.

A plan holds no device memory, so its byte and FLOP counts are known without a GPU (which also sizes how many
layers fit). :mod:`.synthetic_run` builds plans in GPU memory and times them.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import attrs

from ds4_core.quants import block_geometry, tensor_nbytes

#: Device bytes kept free when the number of layers is chosen from free memory (activations, state, CuPy, cuBLAS).
MEMORY_MARGIN = 4_000_000_000
#: Bytes per element of the cached state (the engines keep KV rows, indexer keys and recurrent state in float32).
STATE_ELEMENT_BYTES = 4


@attrs.frozen
class Matrix:
    """``y = W x`` in one GEMV launch; ``groups > 1``: block-diagonal (``groups`` blocks, one ``x`` per block).

    ``rows``, ``cols``: one block ``[out, in]`` in numpy order; ``name``: the GGUF tensor it stands for.
    """

    name: str
    qtype: str
    rows: int
    cols: int
    groups: int = 1

    @property
    def read_bytes(self) -> int:
        return tensor_nbytes(self.qtype, (self.groups * self.rows, self.cols))

    @property
    def resident_bytes(self) -> int:
        return self.read_bytes


@attrs.frozen
class RoutedExperts:
    """``k`` of ``experts`` SwiGLU experts with ids on the device: gate/up ``[inter, hidden]`` (one format, one
    fused launch), then down ``[hidden, down_cols]`` (one launch).

    ``down_cols`` is ``inter`` rounded up to whole blocks of the down format: a 640-wide Q2_K down projection is
    stored zero-padded to 768 columns, as in the published Qwen3.8 Q2 file.
    """

    name: str
    gate_up: str
    down: str
    experts: int
    k: int
    hidden: int
    inter: int

    @property
    def down_cols(self) -> int:
        qk = block_geometry(self.down)[0]
        return -(-self.inter // qk) * qk

    @property
    def expert_bytes(self) -> int:
        return (2 * tensor_nbytes(self.gate_up, (self.inter, self.hidden))
                + tensor_nbytes(self.down, (self.hidden, self.down_cols)))

    @property
    def read_bytes(self) -> int:
        return self.k * self.expert_bytes

    @property
    def resident_bytes(self) -> int:
        return self.experts * self.expert_bytes


@attrs.frozen
class StateRead:
    """``rows × width`` float32 state values one decode step reads (cache rows, indexer keys, recurrent state),
    timed as one float32 GEMV over a buffer of exactly that size (a query against every row it reads)."""

    name: str
    rows: int
    width: int

    @property
    def read_bytes(self) -> int:
        return self.rows * self.width * STATE_ELEMENT_BYTES

    @property
    def resident_bytes(self) -> int:
        return self.read_bytes


Plan = list[Matrix | RoutedExperts | StateRead]


@attrs.frozen
class SyntheticModel:
    """A model ``ds4 bench --synthetic`` can build.

    ``plan(recipe, layers)``: the weights of its first ``layers`` decoder layers plus the head at full shapes
    (layer items are named ``blk.{i}.…``). ``state(layers, context)``: the :class:`StateRead` items of those layers
    for one token decoded with ``context`` tokens in the cache (itself included). ``recipes`` maps each recipe name
    to a one-line description; ``state_note`` says which state reads ``state`` models.
    """

    title: str
    layers: int
    recipes: dict[str, str]
    plan: Callable[[str, int], Plan]
    state: Callable[[int, int], Plan]
    state_note: str


def read_bytes(plan: Plan) -> int:
    """Bytes one decode step of ``plan`` reads."""
    return sum(item.read_bytes for item in plan)


def resident_bytes(plan: Plan) -> int:
    """Device bytes ``plan`` occupies (every routed expert, not only the ``k`` read)."""
    return sum(item.resident_bytes for item in plan)


def state_rows(name: str, rows: int, width: int) -> Plan:
    """``[StateRead(name, rows, width)]``, or nothing when there are no rows yet (a short context)."""
    return [StateRead(name, rows, width)] if rows > 0 else []


def selected_tokens(context: int, block: int, budget: int) -> int:
    """Tokens a pooled / block-sparse selection attends with ``context`` visible tokens: the ``budget // block``
    best complete blocks of ``block`` tokens (all of them while there are no more) plus the open tail."""
    return block * min(budget // block, context // block) + context % block


def fitting_layers(model: SyntheticModel, recipe: str, free_bytes: int) -> int:
    """The most layers (≥ 1, ≤ ``model.layers``) whose weights fit in ``free_bytes`` less :data:`MEMORY_MARGIN`."""
    budget = free_bytes - MEMORY_MARGIN
    return next((n for n in range(model.layers, 0, -1) if resident_bytes(model.plan(recipe, n)) <= budget), 1)


@attrs.frozen
class PrefillMatmul:
    """One dense matmul shape of prefill, ``[T, cols] @ [rows, cols]ᵀ``, made ``calls`` times per model by the
    tensors ``names`` (a grouped matrix counts once per group)."""

    names: tuple[str, ...]
    qtype: str
    rows: int
    cols: int
    calls: int

    def flops(self, tokens: int) -> int:
        """Multiply-adds × 2 of one call at ``tokens`` tokens."""
        return 2 * tokens * self.rows * self.cols


@attrs.frozen
class PrefillExperts:
    """The routed experts of one MoE layer shape, run ``calls`` times per model (once per MoE layer)."""

    experts: RoutedExperts
    calls: int

    def flops(self, tokens: int) -> int:
        """Multiply-adds × 2 of one call: ``tokens · k`` (token, expert) pairs through gate, up and down at the
        model's own ``inter`` (zero padding of the down rows is not useful work)."""
        e = self.experts
        return 2 * tokens * e.k * 3 * e.inter * e.hidden


_LAYER = re.compile(r"^blk\.\d+\.")


def prefill_plan(plan: Plan) -> tuple[list[PrefillMatmul], list[PrefillExperts]]:
    """The distinct dense matmuls and routed-expert shapes of prefill over the decoder layers of ``plan`` (a whole
    model's weight plan), each with its calls per model, in order of first use.

    The head is left out (prefill needs the last token's logits only), and so is state (attention is not a
    weight matmul).
    """
    dense: dict[tuple[str, int, int], tuple[list[str], int]] = {}
    routed: dict[RoutedExperts, int] = {}
    for item in plan:
        if not _LAYER.match(item.name):
            continue
        if isinstance(item, Matrix):
            names, calls = dense.setdefault((item.qtype, item.rows, item.cols), ([], 0))
            name = _LAYER.sub("", item.name)
            if name not in names:
                names.append(name)
            dense[item.qtype, item.rows, item.cols] = (names, calls + item.groups)
        elif isinstance(item, RoutedExperts):
            key = attrs.evolve(item, name=_LAYER.sub("", item.name))
            routed[key] = routed.get(key, 0) + 1
    return ([PrefillMatmul(tuple(names), qtype, rows, cols, calls)
             for (qtype, rows, cols), (names, calls) in dense.items()],
            [PrefillExperts(experts, calls) for experts, calls in routed.items()])
