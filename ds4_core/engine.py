"""Engine and Session: load a GGUF with the right plugins, then feed, sample and chat.

``Engine.load(path)`` resolves the model plugin from ``general.architecture``,
picks a backend, uploads the weights and returns an :class:`Engine`.
``engine.new_session()`` gives a :class:`Session` holding one sequence's
decoding state.
"""

from __future__ import annotations

import inspect
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import numpy as np

from .backend import Backend, Ops, WeightLoader
from .chat import ChatFormat, StreamEvent, Thinking
from .descriptors import BackendSpec, ModelSpec, resolve
from .errors import BackendError, ContextError, DeviceMemoryError, Ds4Error, ModelConfigError
from .gguf import GGUFFile
from .log import get_logger
from .memory import human_bytes
from .model import Model, copy_state, restore_state_into
from .plugins import PluginManager, Registry, get_plugin_manager
from .sampling import Sampler, SamplingParams
from .stops import StopScanner
from .tokenizer import Tokenizer

_MEMORY_ADVICE = ("close what else holds that memory, or use a smaller quantization of the model, another backend "
                  "(--backend) or a device with more memory")


@attrs.frozen
class BackendChoice:
    """One backend considered by selection, and why it was or was not usable."""

    spec: BackendSpec
    usable: bool
    reason: str


def probe_backends(registry: Registry, model: ModelSpec | None = None,
                   quant_types: Iterable[str] = ()) -> list[BackendChoice]:
    """Probe every registered backend (highest priority first) against a model's ops and quant types."""
    quant_types = set(quant_types)
    choices = []
    for spec in sorted(registry.backends.values(), key=lambda s: -s.priority):
        try:
            ok, reason = resolve(spec.probe)()
        except Exception as exc:
            ok, reason = False, f"probe failed: {type(exc).__name__}: {exc}"
        if ok and model is not None:
            missing = sorted(set(model.ops) - set(registry.kernels_for(spec.name)))
            if missing:
                ok, reason = False, f"no kernels for ops: {', '.join(missing)}"
        if ok and quant_types and spec.quant_types:
            unsupported = sorted(quant_types - set(spec.quant_types))
            if unsupported:
                ok, reason = False, f"cannot hold tensor types: {', '.join(unsupported)}"
        choices.append(BackendChoice(spec, bool(ok), reason))
    return choices


def bound_ops(registry: Registry, name: str, backend: Backend) -> Ops:
    """The kernels that plugins register for backend ``name``, resolved and bound to ``backend``, as a model runs
    them."""
    return Ops(backend, {op: resolve(k.impl) for op, k in registry.kernels_for(name).items()})


def _choose_backend(registry: Registry, name: str, model: ModelSpec, quant_types: set[str]) -> BackendSpec:
    choices = probe_backends(registry, model, quant_types)
    if name != "auto":
        spec = registry.backend(name)
        if spec is None:
            known = ", ".join(sorted(registry.backends)) or "none"
            raise BackendError(f"unknown backend {name!r}; installed backends: {known} "
                               f"(install one with e.g. pip install 'ds4-core[cuda]')")
        choice = next(c for c in choices if c.spec is spec)
        if not choice.usable:
            raise BackendError(f"backend {spec.name!r} cannot run this model: {choice.reason}")
        return spec
    for choice in choices:
        if choice.usable:
            return choice.spec
    lines = "\n".join(f"  {c.spec.name}: {c.reason}" for c in choices)
    raise BackendError(f"no backend can run model {model.name!r}:\n{lines}")


class Engine:
    """A loaded model with its tokenizer, chat format and backend."""

    def __init__(self, *, path: Path, gguf: GGUFFile, spec: ModelSpec, model: Model, backend: Backend,
                 ops: Ops, tokenizer: Tokenizer, chat_format: ChatFormat | None, ctx: int, registry: Registry):
        self.path = path
        self.gguf = gguf
        self.spec = spec
        self.model = model
        self.backend = backend
        self.ops = ops
        self.tokenizer = tokenizer
        self.chat_format = chat_format
        self.ctx = ctx
        self.registry = registry
        #: Whether the model's forward takes ``last_row`` (see :meth:`ds4_core.model.Model.forward`).
        self.forward_takes_last_row = "last_row" in inspect.signature(model.forward).parameters

    @classmethod
    def load(cls, path: str | Path, *, backend: str = "auto", ctx: int | None = None, plugins: Sequence[Any] = (),
             load_entrypoints: bool = True, progress: bool | Callable[[int, int], None] = False,
             **options: Any) -> Engine:
        """Load the GGUF at ``path``.

        ``backend`` is a backend name or ``"auto"`` (highest-priority backend that covers the
        model's ops and the file's tensor types; never a silent fallback). ``ctx`` is the
        context length (default: the model's maximum, capped at 4096). ``plugins`` are extra
        plugin objects to register; ``progress`` shows a bar on stderr (True) or calls
        ``progress(done_bytes, total_bytes)``. Remaining ``options`` go to the model loader.
        """
        path = Path(path)
        pm = get_plugin_manager() if load_entrypoints and not plugins else PluginManager(
            load_entrypoints=load_entrypoints, plugins=plugins)
        registry = pm.registry
        gguf = GGUFFile.open(path)
        try:
            spec = registry.model_for_architecture(gguf.architecture)
            if spec is None:
                known = sorted(a for s in registry.models.values() for a in s.architectures)
                failed = "".join(f"\n  plugin {i.name} ({i.distribution}) failed: {i.error}" for i in pm.errors())
                raise ModelConfigError(
                    f"{path.name}: no installed model plugin handles architecture {gguf.architecture!r} "
                    f"(known: {', '.join(known) or 'none'}); install the matching plugin, "
                    f"e.g. pip install 'ds4-core[deepseek4]'{failed}")
            quant_types = {t.type_name for t in gguf.tensors.values()}
            bspec = _choose_backend(registry, backend, spec, quant_types)
            be: Backend = resolve(bspec.factory)()
            ops = bound_ops(registry, bspec.name, be)
            tokenizer = Tokenizer.from_metadata(gguf.metadata)
            chat_format = resolve(spec.chat)() if spec.chat else None
            total = sum(t.nbytes for t in gguf.tensors.values())
            need, free = be.weights_nbytes(gguf.tensors.values()), be.free_memory()
            if need is not None and free is not None and need > free:
                raise DeviceMemoryError(f"{path.name}: its weights take {human_bytes(need)} on {bspec.name}, "
                                        f"where {human_bytes(free)} is free; {_MEMORY_ADVICE}")
            log = get_logger(model=spec.name, backend=bspec.name, file=path.name)
            t0 = time.perf_counter()
            loading = _progress(progress, total, f"loading {path.name}")
            with loading as report:
                try:
                    model = resolve(spec.loader)(gguf, WeightLoader(gguf, be, report), ops, dict(options))
                except MemoryError as exc:  # what the check above could not foresee (other processes, extras)
                    be.release_scratch()
                    raise DeviceMemoryError(
                        f"{path.name}: {bspec.name} ran out of memory after loading {human_bytes(loading.done)} of the "
                        f"file's {human_bytes(total)} of tensors ({exc}); {_MEMORY_ADVICE}") from exc
            be.synchronize()
            max_ctx = int(model.max_context)
            ctx = min(max_ctx, 4096) if ctx is None else int(ctx)
            if ctx < 1 or ctx > max_ctx:
                raise ContextError(f"context {ctx} is outside what {spec.name} supports (1..{max_ctx}); "
                                   f"pass a smaller --ctx")
            state, free = model.state_nbytes(ctx), be.free_memory()
            if free is not None and 2 * state > free:  # Session.feed copies the state while it feeds a long prompt
                raise ContextError(f"a context of {ctx} tokens needs {state / 2**30:.2f} GiB of decoding state, "
                                   f"twice over while a long prompt is fed (the copy that undoes a failed feed), "
                                   f"but only {free / 2**30:.2f} GiB is free on {bspec.name}; pass a smaller --ctx")
            log.info("model loaded", seconds=round(time.perf_counter() - t0, 3), ctx=ctx,
                     state_mib=round(model.state_nbytes(ctx) / 2**20, 2))
        except BaseException:
            gguf.close()
            raise
        return cls(path=path, gguf=gguf, spec=spec, model=model, backend=be, ops=ops, tokenizer=tokenizer,
                   chat_format=chat_format, ctx=ctx, registry=registry)

    def new_session(self) -> Session:
        """A fresh session with empty state."""
        return Session(self)

    def sampler(self, params: SamplingParams) -> Sampler:
        """A sampler running the registered stages in order."""
        stages = [resolve(s.impl) for s in sorted(self.registry.samplers.values(), key=lambda s: s.order)]
        return Sampler(params, stages)

    def render(self, messages: Sequence[dict[str, Any]], *, tools: Sequence[dict[str, Any]] | None = None,
               thinking: Thinking = "none") -> list[int]:
        """Token ids of a conversation rendered with the model's chat template."""
        if self.chat_format is None:
            raise Ds4Error(f"model {self.spec.name!r} has no chat format; use generate() with raw text")
        guarded, originals = _guard_specials(messages, self.tokenizer)
        text = self.chat_format.render(guarded, tools=tools, thinking=thinking)
        ids: list[int] = []
        for i, part in enumerate(_SENTINEL.split(text)):
            # even parts are template text; odd parts are sentinel indices of user-supplied strings
            ids += self.tokenizer.encode(part, special=True) if i % 2 == 0 else \
                self.tokenizer.encode(originals[int(part)], special=False)
        return ids

    def chat(self, messages: Sequence[dict[str, Any]], *, tools: Sequence[dict[str, Any]] | None = None,
             thinking: Thinking = "none", max_tokens: int = 512,
             sampling: SamplingParams | None = None) -> Iterator[StreamEvent]:
        """Stream the reply to ``messages`` as chat events (content, reasoning, tool calls)."""
        prompt = self.render(messages, tools=tools, thinking=thinking)
        assert self.chat_format is not None  # render() raised otherwise
        parser = self.chat_format.parser(thinking=thinking, tools=bool(tools))
        stop = tuple(self.chat_format.stop_strings)
        for piece in self.new_session().generate(prompt, max_tokens=max_tokens, sampling=sampling,
                                                 stop_strings=stop):
            yield from parser.feed(piece.text)
        yield from parser.finish()

    def close(self) -> None:
        """Release the model's resources (reader threads, open files; when it has a ``close``) and the GGUF."""
        close_model = getattr(self.model, "close", None)
        if close_model is not None:
            close_model()
        self.gguf.close()


@attrs.frozen
class Generated:
    """One generated token and the text it completed (may be empty mid-UTF-8 sequence)."""

    id: int
    text: str


@attrs.frozen
class Snapshot:
    """A session's state at one point, restorable any number of times."""

    tokens: tuple[int, ...]
    state: Any
    last_logits: np.ndarray | None


class Session:
    """One sequence's decoding state on an engine."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.tokens: list[int] = []
        self.state = engine.model.new_state(engine.ctx)
        # The last fed token's logits [vocab]: as a backend array (what sample() reads, on the device where the
        # backend samples) and as a host copy made on first use; at least one is set once a token was fed.
        self._last_row: Any = None
        self._last_host: np.ndarray | None = None
        self.prefill_chunk = engine.backend.prefill_chunk
        #: Why the state cannot be trusted (a fault inside a one-chunk feed), or None; cleared by :meth:`restore`.
        self._broken: str | None = None

    @property
    def last_logits(self) -> np.ndarray | None:
        """float32 logits ``[vocab]`` after the last fed token (None before any), copied to the host on first read:
        a decode loop that samples with :meth:`sample` on a backend that samples never copies them."""
        if self._last_host is None and self._last_row is not None:
            self._last_host = np.array(self.engine.backend.to_numpy(self._last_row), dtype=np.float32)
        return self._last_host

    @property
    def has_logits(self) -> bool:
        """Whether a token was fed since the session began or was restored to logits (what :meth:`sample` needs),
        without copying the row to the host."""
        return self._last_row is not None or self._last_host is not None

    def _row(self) -> Any:
        """The last logits as a backend array (uploaded once after a restore), or None before any feed."""
        if self._last_row is None and self._last_host is not None:
            self._last_row = self.engine.backend.asarray(self._last_host)
        return self._last_row

    def sample(self, sampler: Sampler) -> int:
        """The next token id ``sampler`` draws from :attr:`last_logits`: on the backend where it can (the same id
        the host would draw, with the same use of ``sampler.rng``), else on a host copy of the row."""
        row = self._row()
        if row is None:
            raise Ds4Error("nothing to sample from: feed tokens first")
        token = self.engine.backend.sample(row, sampler)
        return sampler.sample(self.last_logits) if token is None else token

    @property
    def remaining(self) -> int:
        """Tokens that still fit in the context."""
        return self.engine.ctx - len(self.tokens)

    def feed(self, token_ids: Sequence[int] | np.ndarray, *,
             logits: Literal["all", "last", "none"] = "all") -> np.ndarray:
        """Advance the state by ``token_ids``; return float32 logits ``[n, vocab]``, one row per token, or with
        ``logits="last"`` only the last row ``[1, vocab]``: a prompt fed to sample from its end needs no more, and
        every other row would cross to the host (2048 rows of a 129K vocabulary are 1 GB). ``logits="none"``
        returns no row (``[0, vocab]``): the last row stays on the backend for :meth:`sample` (a decode step then
        brings back a token id, not the row) and reaches the host only if :attr:`last_logits` is read.

        Atomic: if it raises, the session is as before the call (state, tokens, last logits). A feed longer
        than :attr:`prefill_chunk` runs in chunks, each advancing the state, so it first copies the state
        (one extra :meth:`Model.state_nbytes` for the length of the call) and puts it back on any failure,
        Ctrl-C included. A one-chunk feed (every decoding step) copies nothing: the models refuse bad input
        with a :class:`Ds4Error` before writing any state. Only a fault inside the graph of a one-chunk feed
        (an interrupt, a device error) can leave the state half-written; the session then refuses to go on
        until :meth:`restore` rather than continue from it.
        """
        self._check_usable()
        if logits not in ("all", "last", "none"):
            raise Ds4Error(f"logits must be 'all' or 'last' (the rows to return) or 'none', not {logits!r}")
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            return np.zeros((0, self.engine.model.vocab_size), np.float32)
        vocab = self.engine.model.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            bad = int(ids.max() if ids.max() >= vocab else ids.min())
            raise Ds4Error(f"token id {bad} is out of range 0..{vocab - 1} for this model")
        if ids.size > self.remaining:
            raise ContextError(f"{ids.size} tokens do not fit: {len(self.tokens)} of {self.engine.ctx} context "
                               f"tokens are used; start a new session or load with a larger ctx")
        saved = copy_state(self.state) if ids.size > self.prefill_chunk else None
        n_tokens, last = len(self.tokens), (self._last_row, self._last_host)
        out = [np.zeros((0, vocab), np.float32)]
        try:
            for start in range(0, ids.size, self.prefill_chunk):
                chunk = ids[start:start + self.prefill_chunk].astype(np.int32)
                if logits != "all" and self.engine.forward_takes_last_row:  # no head on unread rows
                    rows = self.engine.model.forward(chunk, self.state, last_row=True)
                else:
                    rows = self.engine.model.forward(chunk, self.state)
                if logits == "all" or (logits == "last" and start + self.prefill_chunk >= ids.size):
                    host = rows if logits == "all" else rows[-1:]  # "last": only the last chunk's last row
                    out.append(np.asarray(self.engine.backend.to_numpy(host), dtype=np.float32))
            if saved is not None:  # each chunk of a long prompt took a little more scratch than the last
                self.engine.backend.release_scratch()
            result = np.concatenate(out, axis=0)
            # a view of a longer chunk would hold all its rows (2048 x 129K floats) alive: copy that one row
            self._last_row = rows[-1] if len(rows) == 1 else self.engine.backend.xp.array(rows[-1])
            self._last_host = result[-1].copy() if len(result) else None
            self.tokens.extend(ids.tolist())
        except BaseException as exc:
            del self.tokens[n_tokens:]
            self._last_row, self._last_host = last
            if saved is not None:
                if not restore_state_into(self.state, saved):
                    self.state = saved
            elif not isinstance(exc, Ds4Error):
                self._broken = f"a feed was stopped inside the model ({type(exc).__name__})"
            raise
        return result

    def snapshot(self) -> Snapshot:
        """Capture the current state."""
        self._check_usable()
        logits = None if self.last_logits is None else self.last_logits.copy()
        return Snapshot(tuple(self.tokens), copy_state(self.state), logits)

    def restore(self, snap: Snapshot) -> None:
        """Return to ``snap`` exactly (the snapshot stays reusable)."""
        self.tokens = list(snap.tokens)
        if not restore_state_into(self.state, snap.state):  # in place where it can: decode graphs stay valid
            self.state = copy_state(snap.state)
        self._last_row = None  # uploaded when sample() needs it
        self._last_host = None if snap.last_logits is None else snap.last_logits.copy()
        self._broken = None

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise Ds4Error(f"this session's state is incomplete: {self._broken}; restore a snapshot taken before "
                           "it or start a new session")

    def generate(self, prompt: Sequence[int] = (), *, max_tokens: int = 256, sampling: SamplingParams | None = None,
                 stop_ids: Iterable[int] | None = None, stop_strings: Sequence[str] = ()) -> Iterator[Generated]:
        """Feed ``prompt`` then sample up to ``max_tokens`` tokens, yielding each with its text.

        Stops at the tokenizer's EOS (or ``stop_ids``) and after any of ``stop_strings``
        (the stop text itself is not yielded). Closing the generator stops generation cleanly.
        """
        self._check_usable()
        tok = self.engine.tokenizer
        stops = set(stop_ids) if stop_ids is not None else ({tok.eos_id} if tok.eos_id is not None else set())
        sampler = self.engine.sampler(sampling or SamplingParams())
        if len(prompt):
            self.feed(prompt, logits="none")
        if self._row() is None:
            raise Ds4Error("nothing to continue from: give a prompt")
        decoder = tok.incremental_decoder()
        scanner = StopScanner(stop_strings)
        for _ in range(min(max_tokens, self.remaining + 1)):
            token = self.sample(sampler)
            if token in stops:
                break
            text, hit = scanner.push(decoder.push(token))
            if text:
                yield Generated(token, text)
            if hit is not None or self.remaining == 0:
                return
            self.feed([token], logits="none")
        text, _ = scanner.push(decoder.flush())
        if text := text + scanner.flush():
            yield Generated(-1, text)


_SENTINEL = re.compile("\ue000([0-9]+)\ue001")


def _guard_specials(messages: Sequence[dict[str, Any]], tokenizer: Tokenizer) -> tuple[list[dict[str, Any]], list[str]]:
    """Replace message strings that spell special tokens by sentinels, so that text a user typed is never
    read as a role marker or control token. Returns the guarded messages and the replaced strings."""
    originals: list[str] = []

    def guard(value: Any) -> Any:
        if isinstance(value, str) and tokenizer.contains_special(value):
            originals.append(value)
            return f"\ue000{len(originals) - 1}\ue001"
        if isinstance(value, list):
            return [{**p, "text": guard(p["text"])} if isinstance(p, dict) and "text" in p else p for p in value]
        return value

    guarded = [{**m, **{k: guard(m[k]) for k in ("content", "reasoning_content") if k in m}} for m in messages]
    return guarded, originals


class _progress:
    """Context manager yielding ``report(nbytes)``: a rich bar on stderr, a callback, or nothing."""

    def __init__(self, progress: bool | Callable[[int, int], None], total: int, label: str):
        self.progress, self.total, self.label = progress, total, label
        self.done = 0
        self.bar: Any = None

    def __enter__(self) -> Callable[[int], None]:
        if self.progress is True:
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

            from .console import stderr_console

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                TimeRemainingColumn(), console=stderr_console(), transient=True)
            self.bar.start()
            self.task = self.bar.add_task(self.label, total=self.total)
        return self.report

    def report(self, nbytes: int) -> None:
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done)
        elif callable(self.progress):
            self.progress(self.done, self.total)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()
