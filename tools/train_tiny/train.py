"""Train one family's tiny model on the token streams written by ``prepare.py`` (one GPU or CPU, fixed seeds).

The models are defined in ``families.py``: DeepSeek V4 (``DeepseekV4ForCausalLM``: sliding, CSA and HCA
attention, hash-routed and top-k-routed MoE, mHC), GLM 5.3 Flash (``Glm5NextForConditionalGeneration``: KDA and
NoPE MLA with the pooled indexer, hyper-connections) and Qwen3.8 Flash Next (``Qwen4ExpForCausalLM``: gated
delta-net and QSA attention, n-gram PLE, hyper-connections). Routers with a selection bias (DeepSeek, GLM) follow
DeepSeek's auxiliary-loss-free balancing (after each step, the bias is nudged up for under-loaded experts and down
for over-loaded ones); Qwen's softmax router adds transformers' load-balancing loss. With ``--mtp`` the family's
MTP (next-n) block, which transformers does not instantiate, trains jointly (``MTP_WEIGHT`` x its loss, as
DeepSeek V3 does) from the family's ``tools/train_tiny/mtp_FAMILY.py``. Several families can train at once on one
GPU (one process each).

``MtpHead(model)`` contract: an ``nn.Module`` that hooks ``model`` to capture the trunk state its block reads; called
right after the trunk's forward on ``input_ids [B, T]``, it returns logits ``[B, T-1, V]`` where row p predicts token
p+2 from the trunk state at p and the embedding of token p+1. ``checkpoint_tensors()`` returns its weights under the
checkpoint names the family's converter reads (saved as ``model/mtp.safetensors``).

Writes into ``--out``: ``model/`` (save_pretrained in ``--save-dtype`` + tokenizer files), ``loss.json``
(per-step training loss, periodic held-out loss, final held-out loss, and the MTP's) and ``loss.png``.

Run: ``python tools/train_tiny/train.py --family F --data .carry/train_tiny --out OUT [--steps N | --minutes M]``
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from families import FAMILIES, Family
from loss_plot import loss_axes, save

SEQ_LEN = 512
BATCH = 32
PEAK_LR = 3e-3
WARMUP = 100
BIAS_UPDATE_RATE = 1e-3  # aux-loss-free balancing step (DeepSeek V3 uses 0.001)
EVAL_EVERY = 200
EVAL_WINDOWS = 64
MTP_WEIGHT = 0.3  # DeepSeek V3's MTP loss weight early in training
CALIBRATE = (10, 40)  # steps timed to choose the step count when none is given


def batches(stream: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator) -> torch.Tensor:
    """``[batch, seq_len + 1]`` int64 windows starting at uniform random offsets of ``stream``."""
    starts = rng.integers(0, stream.size - seq_len - 1, size=batch)
    return torch.from_numpy(np.stack([stream[s:s + seq_len + 1] for s in starts]).astype(np.int64))


def heldout_windows(stream: np.ndarray, seq_len: int, limit: int | None = None) -> torch.Tensor:
    """Non-overlapping ``[n, seq_len + 1]`` windows (consecutive windows share one boundary token)."""
    n = (stream.size - 1) // seq_len
    n = n if limit is None else min(n, limit)
    return torch.from_numpy(np.stack([stream[i * seq_len:(i + 1) * seq_len + 1] for i in range(n)]).astype(np.int64))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction=reduction)


@torch.no_grad()
def mean_loss(family: Family, model: torch.nn.Module, windows: torch.Tensor, device: str, mtp: Any = None,
              batch: int = 32) -> tuple[float, float | None]:
    """Mean cross-entropy (nats) over all predicted positions of ``windows`` (float32, no autocast): next token,
    and token after next by the MTP head (None without one)."""
    modules = [model, *([mtp] if mtp is not None else [])]
    for module in modules:
        module.eval()
    total, count, total_mtp, count_mtp = 0.0, 0, 0.0, 0
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch].to(device)
        logits = family.forward(model, w[:, :-1])[0]
        total += cross_entropy(logits, w[:, 1:], "sum").item()
        count += w[:, 1:].numel()
        if mtp is not None:
            total_mtp += cross_entropy(mtp(w[:, :-1]), w[:, 2:], "sum").item()
            count_mtp += w[:, 2:].numel()
    for module in modules:
        module.train()
    return total / count, (total_mtp / count_mtp if mtp is not None else None)


class RouterBalancer:
    """Auxiliary-loss-free load balancing of the routers with a selection bias (their forward returns
    ``(logits, weights, indices)``): counts expert loads through forward hooks."""

    def __init__(self, model: torch.nn.Module):
        self.loads: dict[torch.nn.Module, torch.Tensor] = {}
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.register_forward_hook(self._record)

    def _record(self, module: torch.nn.Module, args: tuple, output: tuple) -> None:
        if module.training:
            counts = torch.bincount(output[2].flatten(), minlength=module.num_experts).float()
            self.loads[module] = self.loads.get(module, 0) + counts

    @torch.no_grad()
    def step(self) -> None:
        for module, load in self.loads.items():
            module.e_score_correction_bias += BIAS_UPDATE_RATE * torch.sign(load.mean() - load)
        self.loads.clear()


def lr_at(step: int, total: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < WARMUP:
        return PEAK_LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / max(1, total - WARMUP)
    return PEAK_LR * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train(family: Family, data: Path, out: Path, steps: int | None, minutes: float, seed: int, device: str,
          batch: int = BATCH, save_dtype: torch.dtype = torch.float32, seq_len: int = SEQ_LEN,
          eval_every: int = EVAL_EVERY, final_windows: int | None = None, train_mtp: bool = False,
          overrides: dict | None = None, eval_windows: int = EVAL_WINDOWS) -> dict:
    """Train, evaluate and save; return the log written to ``loss.json``. Without ``steps``, training stops at
    the latest after 1.15 x ``minutes`` even if the calibrated step count was too optimistic. The final held-out
    loss covers every held-out file, or its first ``final_windows`` windows (a CPU run cannot afford them all)."""
    data = data / family.name
    corpus = json.loads((data / "corpus.json").read_text())
    with np.load(data / "tokens.npz") as tokens:
        train_stream, held_stream = tokens["train"], tokens["heldout"]
    model = family.build(corpus["vocab_size"], seed, overrides or {}).to(device)
    mtp = family.build_mtp(model).to(device) if train_mtp else None
    model.train()
    balancer = RouterBalancer(model if mtp is None else torch.nn.ModuleList([model, mtp]))
    params = [*model.parameters(), *(mtp.parameters() if mtp is not None else ())]
    params = list({id(p): p for p in params}.values())  # the MTP head shares the trunk's embedding and head
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=PEAK_LR, betas=(0.9, 0.95), fused=device == "cuda")
    rng = np.random.default_rng(seed)
    periodic_windows = heldout_windows(held_stream, seq_len, eval_windows)
    log: dict = {"family": family.name, "seed": seed, "seq_len": seq_len, "batch": batch, "peak_lr": PEAK_LR,
                 "train_loss": [], "heldout_loss": [], "parameters": sum(p.numel() for p in model.parameters()),
                 "eval_windows": eval_windows, "overrides": overrides or {}}
    if mtp is not None:
        log.update(mtp_weight=MTP_WEIGHT, mtp_train_loss=[], heldout_mtp_loss=[],
                   mtp_parameters=sum(p.numel() for p in mtp.parameters()) - sum(
                       p.numel() for p in model.parameters() if any(p is q for q in mtp.parameters())))
    total = steps or 10**9
    t0 = time.time()
    step = 0
    while step < total:
        if steps is None and step == CALIBRATE[0]:
            t_calibrate = time.time()
        if steps is None and step == CALIBRATE[1]:  # fix the step count from the speed of warm steps
            per_step = (time.time() - t_calibrate) / (CALIBRATE[1] - CALIBRATE[0])
            total = step + int((minutes * 60 - (time.time() - t0)) / per_step)
            print(f"calibrated: {total} steps ({per_step * 1000:.0f} ms/step)", flush=True)
        if steps is None and time.time() - t0 > 1.15 * minutes * 60:  # the calibrated count was too optimistic
            total = step
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total)
        w = batches(train_stream, batch, seq_len, rng).to(device)
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits, aux = family.forward(model, w[:, :-1])
            mtp_logits = mtp(w[:, :-1]) if mtp is not None else None
        loss = cross_entropy(logits, w[:, 1:])
        total_loss = loss if aux is None else loss + aux.float()
        if mtp_logits is not None:
            mtp_loss = cross_entropy(mtp_logits, w[:, 2:])
            total_loss = total_loss + MTP_WEIGHT * mtp_loss
            log["mtp_train_loss"].append(round(mtp_loss.item(), 4))
        opt.zero_grad(set_to_none=True)
        total_loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        balancer.step()
        log["train_loss"].append(round(loss.item(), 4))
        if step % eval_every == 0 or step == total - 1:
            held, held_mtp = mean_loss(family, model, periodic_windows, device, mtp)
            log["heldout_loss"].append([step, round(held, 4)])
            mtp_note = ""
            if held_mtp is not None:
                log["heldout_mtp_loss"].append([step, round(held_mtp, 4)])
                mtp_note = f" mtp {held_mtp:.3f}"
            print(f"step {step}/{total} train {loss.item():.3f} heldout {held:.3f}{mtp_note} "
                  f"{time.time() - t0:.0f}s", flush=True)
        step += 1
    log["steps"] = total
    log["train_seconds"] = round(time.time() - t0, 1)
    log["tokens_seen"] = total * batch * seq_len
    final = heldout_windows(held_stream, seq_len, final_windows)
    log["final_heldout_windows"] = len(final)
    held, held_mtp = mean_loss(family, model, final, device, mtp)
    log["final_heldout_loss"] = round(held, 4)
    print(f"final held-out loss {held:.4f} nats/token", flush=True)
    if held_mtp is not None:
        log["final_heldout_mtp_loss"] = round(held_mtp, 4)
        print(f"final held-out MTP loss (token after next) {held_mtp:.4f} nats/token", flush=True)
    model.to("cpu", save_dtype).save_pretrained(out / "model")
    if mtp is not None:
        from safetensors.torch import save_file

        tensors = {k: v.detach().to("cpu", save_dtype).contiguous() for k, v in mtp.checkpoint_tensors().items()}
        save_file(tensors, out / "model" / "mtp.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json", "corpus.json"):
        shutil.copy(data / name, out / "model" / name)
    (out / "loss.json").write_text(json.dumps(log))
    return log


def plot(family: Family, log: dict, vocab_size: int, path: Path) -> None:
    """Training loss per step (and its moving average) with the periodic held-out loss."""
    fig, ax = loss_axes(log["train_loss"], 25, "training loss")
    windows = log.get("eval_windows", EVAL_WINDOWS)
    held = np.asarray(log["heldout_loss"])
    ax.plot(held[:, 0], held[:, 1], "o-", color="tab:orange", ms=3, label=f"held-out loss ({windows} windows)")
    if log.get("mtp_train_loss"):
        mtp_smooth = np.convolve(log["mtp_train_loss"], np.ones(25) / 25, mode="valid")
        ax.plot(np.arange(24, 24 + mtp_smooth.size), mtp_smooth, color="tab:green",
                label="MTP training loss, token after next (25-step mean)")
        held_mtp = np.asarray(log["heldout_mtp_loss"])
        ax.plot(held_mtp[:, 0], held_mtp[:, 1], "s-", color="tab:red", ms=3, label="MTP held-out loss")
    ax.axhline(math.log(vocab_size), color="gray", ls="--", lw=0.8, label=f"uniform baseline ln({vocab_size})")
    save(fig, ax, xlabel=f"step (batch {log['batch']} x {log['seq_len']} tokens)",
         ylabel="cross-entropy (nats/token)", title=f"tiny {family.title} on the Python standard library", top=9,
         path=path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), required=True)
    parser.add_argument("--data", type=Path, required=True, help="prepare.py's --out (holds one folder per family)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, help="fixed number of steps (default: calibrated from --minutes)")
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=BATCH, help="windows per step")
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN, help="tokens per training window")
    parser.add_argument("--eval-every", type=int, default=EVAL_EVERY, help="steps between held-out evaluations")
    parser.add_argument("--eval-windows", type=int, default=EVAL_WINDOWS, help="held-out windows per evaluation")
    parser.add_argument("--final-windows", type=int, help="score only the first N held-out windows at the end")
    parser.add_argument("--threads", type=int, help="torch CPU threads (CPU runs side by side: 1 each)")
    parser.add_argument("--mtp", action="store_true", help="train the family's MTP block jointly")
    parser.add_argument("--config", type=json.loads, default={}, metavar="JSON",
                        help="model config overrides, e.g. '{\"num_hidden_layers\": 8}'")
    parser.add_argument("--save-dtype", choices=("float32", "float16"), default="float32",
                        help="dtype of the saved floating-point weights (float16 halves the transfer)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = True
    args.out.mkdir(parents=True, exist_ok=True)
    family = FAMILIES[args.family]
    log = train(family, args.data, args.out, args.steps, args.minutes, args.seed, device, args.batch,
                getattr(torch, args.save_dtype), args.seq_len, args.eval_every, args.final_windows, args.mtp,
                args.config, args.eval_windows)
    plot(family, log, json.loads((args.data / family.name / "corpus.json").read_text())["vocab_size"],
         args.out / "loss.png")


if __name__ == "__main__":
    main()
