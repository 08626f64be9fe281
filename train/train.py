"""Trains the default Xing4.0-architecture model (train/xing4.py) on the prepared token streams
and writes its weights as safetensors (F32, GGUF names), for `make-model --weights`.

Next-token cross-entropy on the trunk plus 0.3 × the NextN block's loss on the token after next.
Routed experts are balanced without an auxiliary loss, as DeepSeek-V3 does: after each step a
block's selection bias (`exp_probs_b`, used only to choose experts) moves by `--bias-rate` toward
the experts that were chosen less than average. AdamW, warm-up then cosine decay over the time
budget; the weights kept are those of the best validation loss.

Usage (a machine with an NVIDIA GPU; the CPU works for a smoke run):
    python3 train/train.py --config DIR/config.json --data train/data --out trained.safetensors
"""

import argparse
import copy
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from xing4 import Config, Xing4, save_safetensors  # noqa: E402


def batches(data, batch, ctx, gen, device):
    """Random windows of ctx+2 tokens: inputs, next tokens, the tokens after next."""
    starts = torch.randint(0, len(data) - ctx - 2, (batch,), generator=gen)
    rows = np.stack([data[s : s + ctx + 2] for s in starts.tolist()]).astype(np.int64)
    t = torch.from_numpy(rows).to(device, non_blocking=True)
    return t[:, :ctx], t[:, 1 : ctx + 1], t[:, 2 : ctx + 2]


def losses(model, x, y, y2, use_nextn):
    if use_nextn:
        logits, logits2 = model(x, next_tokens=y)
        l1 = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        l2 = F.cross_entropy(logits2.flatten(0, 1), y2.flatten())
        return l1, l2
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten()), None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--data", default="train/data")
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=8.0, help="training time budget")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: the budget)")
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--nextn-weight", type=float, default=0.3)
    ap.add_argument("--dropout", type=float, default=0.1, help="on sub-layer outputs, training only")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    t_start = time.time()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(args.seed)
    dev = torch.device(args.device)
    cfg = Config.load(args.config)
    train = np.fromfile(os.path.join(args.data, "train.bin"), dtype=np.uint16)
    val = np.fromfile(os.path.join(args.data, "val.bin"), dtype=np.uint16)
    assert int(train.max()) < cfg.vocab, "the token streams were made with another vocabulary"
    model = Xing4(cfg, seed=args.seed).to(dev)
    model.dropout = args.dropout
    n_params = sum(p.numel() for p in model.parameters())
    print(f"train: {n_params:,} parameters; {len(train):,} training and {len(val):,} validation tokens; "
          f"batch {args.batch} x {args.ctx} on {dev}", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 and not n.endswith("exp_probs_b__bias")]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda",
    )
    use_nextn = cfg.n_nextn > 0
    amp = dict(device_type=dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
    gen = torch.Generator().manual_seed(args.seed)
    vgen = torch.Generator().manual_seed(12345)
    val_batches = [batches(val, args.batch, args.ctx, vgen, dev) for _ in range(4)]

    def evaluate():
        model.eval()
        tot, tot2 = 0.0, 0.0
        with torch.no_grad(), torch.autocast(**amp):
            for x, y, y2 in val_batches:
                l1, l2 = losses(model, x, y, y2, use_nextn)
                tot += l1.item()
                tot2 += l2.item() if l2 is not None else 0.0
        model.train()
        return tot / len(val_batches), tot2 / len(val_batches)

    budget = args.minutes * 60 - (time.time() - t_start)
    t0 = time.time()
    total_steps = args.max_steps or 10**9
    best = (float("inf"), None, 0)
    history = []
    step = 0
    tokens = 0
    while step < total_steps:
        elapsed = time.time() - t0
        if not args.max_steps and elapsed > budget:
            break
        if step == 50 and not args.max_steps:
            # The schedule's length, from the speed of the first steps.
            per_step = elapsed / 50
            total_steps = max(100, int(budget / per_step * 0.93))
            print(f"train: {per_step * 1000:.1f} ms a step; planning {total_steps} steps", flush=True)
        lr_scale = min(1.0, (step + 1) / args.warmup)
        if step >= args.warmup and total_steps < 10**9:
            prog = (step - args.warmup) / max(1, total_steps - args.warmup)
            lr_scale = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, prog)))
        for g in opt.param_groups:
            g["lr"] = args.lr * lr_scale
        x, y, y2 = batches(train, args.batch, args.ctx, gen, dev)
        with torch.autocast(**amp):
            l1, l2 = losses(model, x, y, y2, use_nextn)
            loss = l1 + args.nextn_weight * l2 if l2 is not None else l1
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for b, load in model.loads.items():
                bias = model.w(b + "exp_probs_b.bias")
                bias += args.bias_rate * torch.sign(load.float().mean() - load.float())
        step += 1
        tokens += x.numel()
        if step % args.eval_every == 0 or step == total_steps:
            v1, v2 = evaluate()
            history.append({"step": step, "seconds": round(time.time() - t0, 1), "train": round(l1.item(), 4),
                            "val": round(v1, 4), "val_nextn": round(v2, 4)})
            print(f"step {step}: train {l1.item():.4f}  val {v1:.4f}  val(nextn) {v2:.4f}  "
                  f"lr {args.lr * lr_scale:.2e}  {time.time() - t0:.0f} s", flush=True)
            if v1 < best[0]:
                best = (v1, copy.deepcopy({n: p.detach().clone() for n, p in model.named_weights()}), step)
    if best[1] is None:
        v1, _ = evaluate()
        best = (v1, {n: p.detach().clone() for n, p in model.named_weights()}, step)
    seconds = time.time() - t0
    save_safetensors(args.out, [(n, best[1][n]) for n, _, _ in model.shapes])
    summary = {
        "parameters": n_params, "steps": step, "tokens_trained": tokens, "seconds": round(seconds, 1),
        "best_val_loss": round(best[0], 4), "best_step": best[2], "batch": args.batch, "ctx": args.ctx,
        "lr": args.lr, "dropout": args.dropout, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__, "history": history,
    }
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    print(f"train: {step} steps, {tokens:,} tokens in {seconds:.0f} s; best validation loss {best[0]:.4f} "
          f"at step {best[2]}; wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
