#!/usr/bin/env python3
"""Python's side of bench_torch: torch DistributedDataParallel with gloo at 2 processes (started
with torch.multiprocessing, rendezvous by MASTER_ADDR/MASTER_PORT on a free port), on the same
model (mlp, gpt: examples/torch/gpt_model.hpp's, or a TorchScript file), batch and optimizer,
printing the same figures:
  ddp     DistributedDataParallel(model) (default buckets of 25 MiB, allreduces started from
          autograd hooks during backward; backward() returns once they are done);
  local   the same model without DDP and without communication (the ratio's denominator, on
          the same cores under the same load).
Times are the slowest rank's per step (all_reduce MAX outside the timed region), medians of
--steps steps after --warmup, the variants' order rotating every chunk of 5 steps.

Fails fast instead of hanging: every wait (rendezvous, collective) is bounded by --timeout s,
the first process to fail or die ends the others and the script exits non-zero naming it, and
the whole group is bounded by --deadline s.

Run: /usr/bin/python3 bench/torch/ddp_gloo.py [--model mlp|gpt|script] [--script FILE]
     [--batch 64] [--steps 20] [--warmup 3] [--threads 1] [--json out.json] [--port 0]
     [--timeout 120] [--deadline 1800]
"""
import argparse
import ctypes
import datetime
import json
import os
import signal
import socket
import sys
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


def cpu_model():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


class Block(torch.nn.Module):
    """examples/torch/gpt_model.hpp's block: pre-LayerNorm causal self-attention and MLP."""

    def __init__(self, width, heads, dropout):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.ln2 = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, 4 * width)
        self.fc_proj = torch.nn.Linear(4 * width, width)
        self.attn_drop = torch.nn.Dropout(dropout)
        self.resid_drop = torch.nn.Dropout(dropout)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) * (1.0 / (c // self.heads) ** 0.5)
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        att = self.attn_drop(torch.softmax(att.masked_fill(mask, float("-inf")), -1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.resid_drop(self.proj(y))
        return x + self.resid_drop(self.fc_proj(torch.nn.functional.gelu(self.fc(self.ln2(x)))))


class GPT(torch.nn.Module):
    """examples/torch/gpt_model.hpp's byte-level GPT: the output head tied to the token embedding."""

    def __init__(self, layers, heads, width, block, dropout=0.1):
        super().__init__()
        self.wte = torch.nn.Embedding(256, width)
        self.wpe = torch.nn.Embedding(block, width)
        self.drop = torch.nn.Dropout(dropout)
        self.blocks = torch.nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(width)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1])
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for b in self.blocks:
            x = b(x)
        return torch.nn.functional.linear(self.ln_f(x), self.wte.weight)


def make_model(a):
    torch.manual_seed(0)
    if a.model == "gpt":
        return GPT(a.gpt_layers, a.gpt_heads, a.gpt_width, a.gpt_block, dropout=0.0)  # as bench_torch's
    if a.model == "mlp":
        layers = []
        for _ in range(a.layers):
            layers += [torch.nn.Linear(a.width, a.width), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers)
    m = torch.jit.load(a.script)
    m.train()
    return m


def make_batch(a, rank):
    torch.manual_seed(100 + rank)
    if a.model == "gpt":
        return (torch.randint(0, 256, (a.batch, a.gpt_block)), torch.randint(0, 256, (a.batch, a.gpt_block)))
    if a.model == "mlp":
        return torch.randn(a.batch, a.width), torch.randn(a.batch, a.width)
    return torch.randn(a.batch, 3, a.image_size, a.image_size), torch.randint(0, 1000, (a.batch,))


def worker(rank, a, out):
    try:  # Linux: this process is killed when the one that started it dies (no orphaned rank)
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    torch.set_num_threads(a.threads)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(a.port)
    # Every wait bounded: the rendezvous (TCPStore) and each gloo collective give up after
    # --timeout seconds with an error instead of waiting for a peer that is gone.
    dist.init_process_group("gloo", rank=rank, world_size=a.world_size,
                            timeout=datetime.timedelta(seconds=a.timeout))
    x, y = make_batch(a, rank)
    if a.model == "mlp":
        loss_fn = torch.nn.functional.mse_loss
    elif a.model == "gpt":
        loss_fn = lambda out, y: torch.nn.functional.cross_entropy(out.reshape(-1, 256), y.reshape(-1))
    else:
        loss_fn = torch.nn.functional.cross_entropy
    runners = []
    for name in a.variants.split(","):
        model = make_model(a)
        if name == "ddp":
            model = DDP(model)
        elif name != "local":
            raise SystemExit("unknown variant " + name)
        runners.append({"name": name, "model": model,
                        "opt": torch.optim.SGD(model.parameters(), lr=0.01), "samples": []})

    def step(r, keep):
        dist.barrier()
        t0 = time.perf_counter()
        r["opt"].zero_grad()
        loss = loss_fn(r["model"](x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        r["opt"].step()
        t3 = time.perf_counter()
        p = torch.tensor([t1 - t0, t2 - t1, t3 - t2], dtype=torch.float64)
        dist.all_reduce(p, op=dist.ReduceOp.MAX)
        if keep:
            r["samples"].append(p.tolist())

    for r in runners:
        for _ in range(a.warmup):
            step(r, False)
    done, rnd = 0, 0
    while done < a.steps:
        k = min(5, a.steps - done)
        for j in range(len(runners)):
            r = runners[(j + rnd) % len(runners)]
            for _ in range(k):
                step(r, True)
        done += k
        rnd += 1
    if rank == 0:
        numel = sum(p.numel() for p in runners[0]["model"].parameters())  # Python lists a tied weight once
        rows = []
        for r in runners:
            s = r["samples"]
            med = lambda f: statistics.median(f(v) for v in s)
            rows.append({"variant": r["name"], "step_s": med(lambda v: v[0] + v[1] + v[2]),
                         "forward_s": med(lambda v: v[0]), "backward_comm_s": med(lambda v: v[1]),
                         "optimizer_s": med(lambda v: v[2])})
        out.put({"parameters": numel, "rows": rows})
    dist.destroy_process_group()


# Seconds a rank may still run after another exited normally before the group counts as stuck.
EARLY_EXIT_GRACE_S = 30


def free_port():
    """A TCP port nobody listens on now (the kernel's pick), for the group's rendezvous: a fixed
    port that a stale process still holds makes the rendezvous wait for the wrong server."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(a):
    """Starts the world_size processes and watches them: the first that exits with an error (or
    is killed) ends the others at once, and this process exits saying which and why; so does a
    rank that exited normally while others still run EARLY_EXIT_GRACE_S later, and the group
    still running after --deadline seconds. Returns rank 0's result."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=worker, args=(r, a, out), daemon=True) for r in range(a.world_size)]
    for p in procs:
        p.start()
    start = time.monotonic()
    reason = None
    done_at = {}  # rank -> when it was first seen exited with status 0
    while reason is None:
        codes = [p.exitcode for p in procs]
        now = time.monotonic()
        for r, c in enumerate(codes):
            if c == 0:
                done_at.setdefault(r, now)
        bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        running = [r for r, c in enumerate(codes) if c is None]
        if bad:
            r, c = bad[0]
            how = f"was killed by signal {-c}" if c < 0 else f"exited with status {c} (its error is above)"
            reason = f"process {r} of {a.world_size} {how}"
        elif not running:
            break
        elif done_at and now - min(done_at.values()) > EARLY_EXIT_GRACE_S:
            # The ranks leave together (the last collective, then destroy_process_group): one
            # gone this long while others run left them waiting for it. Unless rank 0 sent the
            # result: every rank then took part in every timed step (the figures are complete)
            # and the others are stuck on their way out, which has been seen here under run.sh.
            r = min(done_at, key=done_at.get)
            if 0 in done_at and not out.empty():
                print(f"ddp_gloo.py: processes {running} still running {now - done_at[r]:.0f} s after process {r} "
                      f"exited, with every step done (stuck on the way out?): ended them", file=sys.stderr)
                for p in procs:
                    if p.exitcode is None:
                        p.kill()
                break
            reason = (f"process {r} of {a.world_size} exited (status 0) {now - done_at[r]:.0f} s before "
                      f"processes {running}, which were still running (waiting for it)")
        elif time.monotonic() - start > a.deadline:
            reason = (f"the group was still running after --deadline {a.deadline:.0f} s "
                      f"(processes not done: {[r for r, c in enumerate(codes) if c is None]})")
        else:
            time.sleep(0.2)
    if reason is not None:
        for p in procs:
            if p.exitcode is None:
                p.kill()
        for p in procs:
            p.join(5)
        raise SystemExit(f"ddp_gloo.py: {reason}; the other processes were ended (port {a.port})")
    if out.empty():
        raise SystemExit("ddp_gloo.py: every process exited without error but rank 0 sent no result")
    return out.get()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--script", default="")
    ap.add_argument("--layers", type=int, default=50)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--port", type=int, default=0, help="rendezvous port (0: a free one)")
    ap.add_argument("--timeout", type=float, default=120,
                    help="seconds any one wait (rendezvous, collective) may take before it fails")
    ap.add_argument("--deadline", type=float, default=1800, help="seconds the whole group may run")
    ap.add_argument("--gpt-layers", type=int, default=4)
    ap.add_argument("--gpt-heads", type=int, default=4)
    ap.add_argument("--gpt-width", type=int, default=128)
    ap.add_argument("--gpt-block", type=int, default=64)
    ap.add_argument("--variants", default="ddp,local")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if a.port == 0:
        a.port = free_port()
    res = run_group(a)
    rows = res["rows"]
    local = next((r["backward_comm_s"] for r in rows if r["variant"] == "local"), 0)
    what = (f"MLP {a.layers} x Linear({a.width},{a.width})+ReLU" if a.model == "mlp"
            else f"GPT {a.gpt_layers} layers, width {a.gpt_width}, context {a.gpt_block}" if a.model == "gpt"
            else f"TorchScript {a.script} at {a.image_size}x{a.image_size}")
    print(f"## ddp_gloo.py: {what}, {res['parameters'] / 1e6:.2f} M parameters, batch {a.batch} per rank, "
          f"SGD, {a.world_size} process(es)\n")
    print(f"CPU: {cpu_model()}; torch.set_num_threads({a.threads}) per process; torch {torch.__version__}; "
          f"median of {a.steps} steps after {a.warmup} warm-up; times in ms, each the slowest rank's\n")
    hdr = ["variant", "step", "fwd", "backward()", "comm after", "optimizer", "backward+comm",
           "(backward+comm)/local backward"]
    table = []
    for r in rows:
        ratio = r["backward_comm_s"] / local if local else None
        if ratio is not None:
            r["ratio_to_local_backward"] = ratio
        table.append([f"python-{r['variant']}", f"{r['step_s'] * 1e3:.1f}", f"{r['forward_s'] * 1e3:.1f}",
                      f"{r['backward_comm_s'] * 1e3:.1f}", "0.0", f"{r['optimizer_s'] * 1e3:.1f}",
                      f"{r['backward_comm_s'] * 1e3:.1f}", f"{ratio:.2f}" if ratio is not None else "-"])
    w = [max(len(h), 3, *(len(t[i]) for t in table)) for i, h in enumerate(hdr)]
    line = lambda cells: "| " + " | ".join(
        c.rjust(w[i]) if c[:1].isdigit() else c.ljust(w[i]) for i, c in enumerate(cells)) + " |"
    print(line(hdr))
    print("|" + "|".join("-" * (x + 2) for x in w) + "|")
    for t in table:
        print(line(t))
    print()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"bench": "ddp_gloo", "ranks": a.world_size, "model": a.model, "script": a.script,
                       "parameters": res["parameters"], "batch_per_rank": a.batch, "threads_per_rank": a.threads,
                       "steps": a.steps, "warmup": a.warmup, "cpu": cpu_model(), "torch": torch.__version__,
                       "variants": rows}, f)
            f.write("\n")


if __name__ == "__main__":
    main()
