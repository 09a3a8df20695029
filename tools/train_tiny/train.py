"""Train one family's tiny model on the token streams written by ``prepare.py`` (one GPU or CPU, fixed seeds).

The models are defined in ``families.py``: DeepSeek V4 (``DeepseekV4ForCausalLM``: sliding, CSA and HCA
attention, hash-routed and top-k-routed MoE, mHC), GLM 5.3 Flash (``Glm5NextForConditionalGeneration``: KDA and
NoPE MLA with the pooled indexer, hyper-connections) and Qwen3.8 Flash Next (``Qwen4ExpForCausalLM``: gated
delta-net and QSA attention, n-gram PLE, hyper-connections). Routers with a selection bias (DeepSeek, GLM) follow
DeepSeek's auxiliary-loss-free balancing (after each step, the bias is nudged up for under-loaded experts and down
for over-loaded ones); Qwen's softmax router adds transformers' load-balancing loss. MTP blocks are not trained:
transformers does not instantiate them. Several families can train at once on one GPU (one process each).

Writes into ``--out``: ``model/`` (save_pretrained in ``--save-dtype`` + tokenizer files), ``loss.json``
(per-step training loss, periodic held-out loss, final held-out loss) and ``loss.png``.

Run: ``python tools/train_tiny/train.py --family F --data .carry/train_tiny --out OUT [--steps N | --minutes M]``
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from families import FAMILIES, Family

SEQ_LEN = 512
BATCH = 32
PEAK_LR = 3e-3
WARMUP = 100
BIAS_UPDATE_RATE = 1e-3  # aux-loss-free balancing step (DeepSeek V3 uses 0.001)
EVAL_EVERY = 200
EVAL_WINDOWS = 64
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


@torch.no_grad()
def mean_loss(family: Family, model: torch.nn.Module, windows: torch.Tensor, device: str, batch: int = 32) -> float:
    """Mean next-token cross-entropy (nats) over all predicted positions of ``windows`` (float32, no autocast)."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch].to(device)
        logits = family.forward(model, w[:, :-1])[0].float()
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        count += w[:, 1:].numel()
    model.train()
    return total / count


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
          eval_every: int = EVAL_EVERY, final_windows: int | None = None) -> dict:
    """Train, evaluate and save; return the log written to ``loss.json``. Without ``steps``, training stops at
    the latest after 1.15 x ``minutes`` even if the calibrated step count was too optimistic. The final held-out
    loss covers every held-out file, or its first ``final_windows`` windows (a CPU run cannot afford them all)."""
    data = data / family.name
    corpus = json.loads((data / "corpus.json").read_text())
    with np.load(data / "tokens.npz") as tokens:
        train_stream, held_stream = tokens["train"], tokens["heldout"]
    model = family.build(corpus["vocab_size"], seed).to(device)
    model.train()
    balancer = RouterBalancer(model)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=PEAK_LR, betas=(0.9, 0.95), fused=device == "cuda")
    rng = np.random.default_rng(seed)
    eval_windows = heldout_windows(held_stream, seq_len, EVAL_WINDOWS)
    log: dict = {"family": family.name, "seed": seed, "seq_len": seq_len, "batch": batch, "peak_lr": PEAK_LR,
                 "train_loss": [], "heldout_loss": [], "parameters": sum(p.numel() for p in model.parameters())}
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
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        (loss if aux is None else loss + aux.float()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        balancer.step()
        log["train_loss"].append(round(loss.item(), 4))
        if step % eval_every == 0 or step == total - 1:
            held = mean_loss(family, model, eval_windows, device)
            log["heldout_loss"].append([step, round(held, 4)])
            print(f"step {step}/{total} train {loss.item():.3f} heldout {held:.3f} "
                  f"{time.time() - t0:.0f}s", flush=True)
        step += 1
    log["steps"] = total
    log["train_seconds"] = round(time.time() - t0, 1)
    log["tokens_seen"] = total * batch * seq_len
    final = heldout_windows(held_stream, seq_len, final_windows)
    log["final_heldout_windows"] = len(final)
    log["final_heldout_loss"] = round(mean_loss(family, model, final, device), 4)
    print(f"final held-out loss {log['final_heldout_loss']:.4f} nats/token", flush=True)
    model.to("cpu", save_dtype).save_pretrained(out / "model")
    for name in ("tokenizer.json", "tokenizer_config.json", "corpus.json"):
        shutil.copy(data / name, out / "model" / name)
    (out / "loss.json").write_text(json.dumps(log))
    return log


def plot(family: Family, log: dict, vocab_size: int, path: Path) -> None:
    """Training loss per step (and its moving average) with the periodic held-out loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loss = np.asarray(log["train_loss"])
    smooth = np.convolve(loss, np.ones(25) / 25, mode="valid")
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(loss, color="tab:blue", alpha=0.25, lw=0.8, label="training loss (per step)")
    ax.plot(np.arange(24, 24 + smooth.size), smooth, color="tab:blue", label="training loss (25-step mean)")
    held = np.asarray(log["heldout_loss"])
    ax.plot(held[:, 0], held[:, 1], "o-", color="tab:orange", ms=3, label=f"held-out loss ({EVAL_WINDOWS} windows)")
    ax.axhline(math.log(vocab_size), color="gray", ls="--", lw=0.8, label=f"uniform baseline ln({vocab_size})")
    ax.set_xlabel(f"step (batch {log['batch']} x {log['seq_len']} tokens)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"tiny {family.title} on the Python standard library")
    ax.set_ylim(0, 9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


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
    parser.add_argument("--final-windows", type=int, help="score only the first N held-out windows at the end")
    parser.add_argument("--threads", type=int, help="torch CPU threads (CPU runs side by side: 1 each)")
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
                getattr(torch, args.save_dtype), args.seq_len, args.eval_every, args.final_windows)
    plot(family, log, json.loads((args.data / family.name / "corpus.json").read_text())["vocab_size"],
         args.out / "loss.png")


if __name__ == "__main__":
    main()
