"""Train the DeepSeek V4 MTP (next-n) block of a shipped tiny GGUF on its frozen trunk, on the CPU (issue #6).

1. Trunk states: ds4's numpy engine runs the GGUF over random training windows and keeps, per position p, the final
   stream state ``S[p] [n, D]`` before the HyperHead (``model.last_stream``), the exact state the drafter reads at
   inference. Cached in ``--work`` (several worker processes, one BLAS thread each).
2. Training: ``MtpHead`` (``mtp_deepseek4.py``) on those states; the token embedding and the LM head are the GGUF's
   own (dequantized as ds4 reads them) and frozen, so only the block's own weights learn (AdamW, aux-loss-free
   router balancing as in ``train.py``, fixed seeds). Held-out MTP loss is logged on states of held-out windows.
3. Output: every metadata key and trunk tensor of the input GGUF unchanged, plus the ``mtp.0.*`` tensors named and
   typed by the converter's own plan (``convert.plan_tensors`` at ``--outtype q8_0``); the trunk's bytes are then
   checked identical, and the held-out MTP loss is re-measured by ds4's numpy ``MtpDrafter``.

Run: ``PYTHONPATH=.:plugins/models/deepseek4 python tools/train_tiny/train_mtp_frozen.py --data .carry/train_tiny
--gguf IN.gguf --out OUT.gguf --work DIR [--state-tokens N --minutes M]``
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from loss_plot import loss_axes, save

if TYPE_CHECKING:
    import torch

SEQ_LEN = 512
HELDOUT_WINDOWS = 16  # held-out windows whose states score the block during training
FAMILY = "deepseek4"


# ---------------------------------------------------------------- 1. trunk states from ds4's numpy engine


def _window_states(args: tuple[str, np.ndarray]) -> np.ndarray:
    """Final stream states ``[n_windows, L - 1, n, D]`` (float32) of windows ``[n_windows, L + 1]``: the trunk
    reads ``w[:L]``; the last position's state is dropped (its token after next lies outside the window)."""
    gguf_path, windows = args
    from ds4_core.engine import Engine

    engine = Engine.load(gguf_path, backend="numpy")
    model = engine.model
    out = []
    for w in windows:
        ids = w[:-1].astype(np.int32)
        model.forward(ids, model.new_state(len(ids)))
        out.append(np.asarray(model.last_stream[:-1], dtype=np.float32))
    engine.close()
    return np.stack(out)


def trunk_states(gguf_path: Path, windows: np.ndarray, workers: int) -> np.ndarray:
    """States of ``windows [N, L + 1]`` as :func:`_window_states`, split over ``workers`` processes."""
    os.environ.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    shards = np.array_split(windows, workers)
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        parts = pool.map(_window_states, [(str(gguf_path), shard) for shard in shards if len(shard)])
    return np.concatenate(parts)


def cached_states(work: Path, gguf_path: Path, name: str, windows: np.ndarray, workers: int) -> np.ndarray:
    """:func:`trunk_states` of ``windows``, cached in ``work/NAME.npz`` (recomputed when the windows differ)."""
    path = work / f"{name}.npz"
    if path.is_file():
        with np.load(path) as cached:
            if np.array_equal(cached["windows"], windows):
                return cached["states"]
    t0 = time.time()
    states = trunk_states(gguf_path, windows, workers)
    print(f"{name}: trunk states of {windows.shape[0]} x {windows.shape[1] - 1} tokens in {time.time() - t0:.0f}s",
          flush=True)
    np.savez(path, windows=windows, states=states)
    return states


def training_windows(stream: np.ndarray, n: int, seq_len: int, seed: int) -> np.ndarray:
    """``[n, seq_len + 1]`` windows at seeded uniform random offsets of ``stream``."""
    starts = np.random.default_rng(seed).integers(0, stream.size - seq_len - 1, size=n)
    return np.stack([stream[s:s + seq_len + 1] for s in starts])


def heldout_windows(stream: np.ndarray, n: int, seq_len: int) -> np.ndarray:
    """The first ``n`` non-overlapping ``[seq_len + 1]`` windows of ``stream`` (as ``train.py`` scores them)."""
    return np.stack([stream[i * seq_len:(i + 1) * seq_len + 1] for i in range(n)])


# ---------------------------------------------------------------- 2. training the block on the frozen trunk


PEAK_LR = 2e-3
WARMUP = 30
BATCH = 4  # windows (of SEQ_LEN - 1 rows) per step
EVAL_EVERY = 25


def lr_at(step: int, total: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak (as ``train.py``)."""
    if step < WARMUP:
        return PEAK_LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / max(1, total - WARMUP)
    return PEAK_LR * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def build_head(engine: Any, seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(trunk, MtpHead)``: a ``DeepseekV4ForCausalLM`` of the shipped config that only hosts the shared modules,
    its embedding and LM head replaced by the GGUF's (as ds4's numpy backend dequantizes them) and frozen."""
    import torch
    from families import FAMILIES
    from mtp_deepseek4 import MtpHead

    family = FAMILIES[FAMILY]
    trunk = family.build(engine.model.vocab_size, seed, {})
    with torch.no_grad():
        trunk.model.embed_tokens.weight.copy_(torch.from_numpy(np.asarray(engine.model.token_embd.data)))
        trunk.lm_head.weight.copy_(torch.from_numpy(np.asarray(engine.model.output.data)))
    trunk.requires_grad_(False)
    torch.manual_seed(seed)
    return trunk, MtpHead(trunk)


def mtp_loss(head: torch.nn.Module, windows: np.ndarray, states: np.ndarray,
             reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``head`` on ``windows [B, L + 1]`` with trunk ``states [B, L - 1, n, D]``: rows p = 0..L-2
    predict ``windows[:, p + 2]``."""
    import torch

    ids = torch.from_numpy(windows.astype(np.int64))
    logits = head(ids[:, :-1], torch.from_numpy(states))
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 2:].flatten(), reduction=reduction)


def heldout_mtp_loss(head: torch.nn.Module, windows: np.ndarray, states: np.ndarray) -> float:
    """Mean :func:`mtp_loss` (nats/token) over ``windows`` in evaluation mode."""
    import torch

    head.eval()
    with torch.no_grad():
        total = sum(mtp_loss(head, windows[i:i + BATCH], states[i:i + BATCH], "sum").item()
                    for i in range(0, len(windows), BATCH))
    head.train()
    return total / (len(windows) * (windows.shape[1] - 2))


def train_head(head: torch.nn.Module, train: tuple[np.ndarray, np.ndarray], held: tuple[np.ndarray, np.ndarray],
               minutes: float, seed: int, log: dict) -> None:
    """AdamW on the block's own weights for ``minutes`` (step count calibrated from the first steps), random
    batches of the cached training windows; router selection biases balanced without an auxiliary loss."""
    import torch
    from train import RouterBalancer

    params = [p for p in head.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=PEAK_LR, betas=(0.9, 0.95))
    balancer = RouterBalancer(head)
    log.update(mtp_parameters=sum(p.numel() for p in params), peak_lr=PEAK_LR, warmup=WARMUP, batch=BATCH,
               train_loss=[], heldout_mtp_loss=[])
    rng = np.random.default_rng(seed)
    head.train()
    t0, total, step = time.time(), 10**9, 0
    while step < total:
        if step == 5:
            t5 = time.time()
        if step == 15:  # fix the step count from the speed of warm steps
            total = step + int((minutes * 60 - (time.time() - t0)) / ((time.time() - t5) / 10))
            print(f"calibrated: {total} steps", flush=True)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total)
        pick = rng.integers(0, len(train[0]), size=BATCH)
        loss = mtp_loss(head, train[0][pick], train[1][pick])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        balancer.step()
        log["train_loss"].append(round(loss.item(), 4))
        if step % EVAL_EVERY == 0 or step == total - 1:
            held_loss = heldout_mtp_loss(head, *held)
            log["heldout_mtp_loss"].append([step, round(held_loss, 4)])
            print(f"step {step}/{total} train {loss.item():.3f} held-out mtp {held_loss:.3f} "
                  f"{time.time() - t0:.0f}s", flush=True)
        step += 1
    log.update(steps=total, train_seconds=round(time.time() - t0, 1),
               tokens_seen=total * BATCH * (train[0].shape[1] - 2))


# ---------------------------------------------------------------- 3. the GGUF: the input file plus mtp.0.*


def _file_tensor(src: Any, info: Any) -> Any:
    """A :class:`PlannedTensor` that re-encodes ``info``'s decoded values; Q8_0/F16/F32/I32 values decoded from a
    file encode back to the same bytes (checked after writing by :func:`check_trunk_unchanged`)."""
    from gguf import GGMLQuantizationType

    from ds4_core.conversion import PlannedTensor
    from ds4_core.quants import dequantize

    def chunks():
        raw = src.tensor_bytes(info.name)
        if info.qtype == GGMLQuantizationType.I32:
            yield raw.view("<i4").reshape(info.shape)
        else:
            yield dequantize(raw, info.qtype, tuple(info.shape))
    return PlannedTensor(info.name, tuple(info.shape), info.qtype, chunks)


def write_with_mtp(src: Any, cfg: Any, trunk: torch.nn.Module, head: torch.nn.Module, out_path: Path) -> None:
    """Write ``src``'s metadata and tensors, then the block's ``mtp.0.*`` tensors, to ``out_path`` (atomically).

    The MTP tensors' names, types and order come from ``convert.plan_tensors`` over the torch trunk's module
    names plus the block's checkpoint names, so they are what ``ds4 convert --outtype q8_0`` writes; the plan's
    trunk part must match ``src``'s tensor directory exactly."""
    from ds4_model_deepseek4.convert import ARCHITECTURE, MTP_PREFIX, ArraySource, plan_tensors

    from ds4_core.conversion import write_gguf_atomic
    from ds4_core.errors import ConversionError

    arrays = {name: t.detach().numpy() for name, t in trunk.state_dict().items()}
    arrays.update({name: t.detach().float().numpy() for name, t in head.checkpoint_tensors().items()})
    plan = plan_tensors(cfg, ArraySource(arrays), "q8_0")
    trunk_plan = [(t.name, t.shape, t.qtype) for t in plan if not t.name.startswith(MTP_PREFIX)]
    if trunk_plan != [(i.name, tuple(i.shape), i.qtype) for i in src.tensors.values()]:
        raise ConversionError(f"{src.path} is not laid out as the converter lays out this trunk; convert the "
                              "trunk again with ds4 convert --outtype q8_0")
    metadata = src.metadata
    rows = [(key, metadata[key], metadata.value_type(key),
             metadata.element_type(key) if isinstance(metadata[key], list) else None)
            for key in metadata if key != "general.architecture"]  # the writer puts the architecture first
    tensors = [_file_tensor(src, info) for info in src.tensors.values()]
    write_gguf_atomic(out_path, ARCHITECTURE, rows, tensors + [t for t in plan if t.name.startswith(MTP_PREFIX)])


def check_trunk_unchanged(old_path: Path, new_path: Path) -> int:
    """Raise unless ``new_path`` holds ``old_path``'s metadata (same keys in order, types, values) and its tensors
    (same names, types, shapes, bytes); return the number of tensors ``new_path`` adds."""
    from ds4_core.gguf import GGUFFile

    with GGUFFile(old_path) as old, GGUFFile(new_path) as new:
        if list(old.metadata) != list(new.metadata):
            raise AssertionError("metadata keys differ")
        for key in old.metadata:
            if (old.metadata[key], old.metadata.value_type(key)) != (new.metadata[key], new.metadata.value_type(key)):
                raise AssertionError(f"metadata {key} differs")
        for name, info in old.tensors.items():
            other = new.tensors[name]
            if (info.qtype, info.shape) != (other.qtype, other.shape) or \
                    old.tensor_bytes(name).tobytes() != new.tensor_bytes(name).tobytes():
                raise AssertionError(f"tensor {name} differs")
        return len(new.tensors) - len(old.tensors)


# ---------------------------------------------------------------- 4. ds4's own numbers on the new file


def drafter_losses(gguf_path: Path, windows: np.ndarray) -> tuple[float, float]:
    """(MTP loss, trunk next-token loss) in nats/token, measured by ds4's numpy backend on ``windows [N, L + 1]``:
    the MTP by ``MtpDrafter.cross_entropy`` (tokens 2..L), the trunk on the same trunk input (tokens 1..L)."""
    from ds4_model_deepseek4.mtp import MtpDrafter

    from ds4_core.engine import Engine
    from ds4_core.scoring import cross_entropy

    engine = Engine.load(gguf_path, backend="numpy")
    drafter = MtpDrafter(engine.model)
    mtp_total = mtp_count = trunk_total = trunk_count = 0
    for w in windows:
        loss, count = drafter.cross_entropy(w)
        mtp_total, mtp_count = mtp_total + loss, mtp_count + count
        logits = engine.model.forward(w[:-1].astype(np.int32), engine.model.new_state(len(w) - 1))
        trunk_total += float(cross_entropy(np.asarray(logits), w[1:].astype(np.int64)).sum())
        trunk_count += len(w) - 1
    engine.close()
    return mtp_total / mtp_count, trunk_total / trunk_count


def plot(log: dict, uniform: float, path: Path) -> None:
    """Training MTP loss per step (and its moving average) with the periodic held-out MTP loss."""
    fig, ax = loss_axes(log["train_loss"], 10, "training MTP loss")
    held = np.asarray(log["heldout_mtp_loss"])
    ax.plot(held[:, 0], held[:, 1], "o-", color="tab:orange", ms=3,
            label=f"held-out MTP loss ({log['heldout_windows']} windows)")
    ax.axhline(log["heldout_trunk_loss_ds4"], color="tab:green", ls=":", lw=1,
               label="frozen trunk's next-token loss (same windows)")
    ax.axhline(uniform, color="gray", ls="--", lw=0.8, label=f"uniform baseline {uniform:.3f}")
    save(fig, ax, xlabel=f"step (batch {log['batch']} x {log['seq_len'] - 1} rows)",
         ylabel="cross-entropy of the token after next (nats)",
         title="tiny DeepSeek V4: MTP block on the frozen trunk (CPU)", top=10, path=path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="prepare.py's --out (holds deepseek4/tokens.npz)")
    parser.add_argument("--gguf", type=Path, required=True, help="the trunk GGUF (no mtp.0.* tensors)")
    parser.add_argument("--out", type=Path, required=True, help="the GGUF to write (trunk + MTP block)")
    parser.add_argument("--work", type=Path, required=True, help="cache of trunk states; loss.json goes here")
    parser.add_argument("--state-windows", type=int, default=600, help=f"training windows of {SEQ_LEN} tokens")
    parser.add_argument("--minutes", type=float, default=12.0, help="training time")
    parser.add_argument("--workers", type=int, default=2, help="processes computing trunk states")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import torch

    from ds4_core.engine import Engine

    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    with np.load(args.data / FAMILY / "tokens.npz") as tokens:
        train_stream, held_stream = tokens["train"], tokens["heldout"]
    train_windows = training_windows(train_stream, args.state_windows, SEQ_LEN, args.seed)
    held = heldout_windows(held_stream, HELDOUT_WINDOWS, SEQ_LEN)
    train = (train_windows, cached_states(args.work, args.gguf, "train", train_windows, args.workers))
    held = (held, cached_states(args.work, args.gguf, "heldout", held, args.workers))
    engine = Engine.load(args.gguf, backend="numpy")
    trunk, head = build_head(engine, args.seed)
    log = {"family": FAMILY, "trunk": args.gguf.name, "seed": args.seed, "seq_len": SEQ_LEN,
           "state_windows": len(train_windows), "state_tokens": int(train_windows.shape[0] * SEQ_LEN),
           "heldout_windows": HELDOUT_WINDOWS, "threads": args.threads}
    train_head(head, train, held, args.minutes, args.seed, log)
    log["final_heldout_mtp_loss_torch"] = round(heldout_mtp_loss(head, *held), 4)
    write_with_mtp(engine.gguf, engine.model.cfg, trunk, head, args.out)
    engine.close()
    log["added_tensors"] = check_trunk_unchanged(args.gguf, args.out)
    mtp, nxt = drafter_losses(args.out, held[0])
    log.update(heldout_mtp_loss_ds4=round(mtp, 4), heldout_trunk_loss_ds4=round(nxt, 4))
    print(f"ds4 numpy on {HELDOUT_WINDOWS} held-out windows: MTP {mtp:.4f}, trunk next-token {nxt:.4f}, "
          f"uniform {math.log(engine.model.vocab_size):.3f} nats/token", flush=True)
    (args.work / "loss.json").write_text(json.dumps(log))
    plot(log, math.log(engine.model.vocab_size), args.work / "loss.png")


if __name__ == "__main__":
    main()
