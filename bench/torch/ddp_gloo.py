#!/usr/bin/env python3
"""Python's side of bench_torch: torch DistributedDataParallel with gloo at 2 processes (started
with torch.multiprocessing, rendezvous by MASTER_ADDR/MASTER_PORT), on the same model, batch
and optimizer, printing the same figures:
  ddp     DistributedDataParallel(model) (default buckets of 25 MiB, allreduces started from
          autograd hooks during backward; backward() returns once they are done);
  local   the same model without DDP and without communication (the ratio's denominator, on
          the same cores under the same load).
Times are the slowest rank's per step (all_reduce MAX outside the timed region), medians of
--steps steps after --warmup, the variants' order rotating every chunk of 5 steps.

Run: /usr/bin/python3 bench/torch/ddp_gloo.py [--model mlp|script] [--script FILE]
     [--batch 64] [--steps 20] [--warmup 3] [--threads 1] [--json out.json]
"""
import argparse
import json
import os
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


def make_model(a):
    torch.manual_seed(0)
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
    if a.model == "mlp":
        return torch.randn(a.batch, a.width), torch.randn(a.batch, a.width)
    return torch.randn(a.batch, 3, a.image_size, a.image_size), torch.randint(0, 1000, (a.batch,))


def worker(rank, a, out):
    torch.set_num_threads(a.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(a.port))
    dist.init_process_group("gloo", rank=rank, world_size=a.world_size)
    x, y = make_batch(a, rank)
    loss_fn = torch.nn.functional.mse_loss if a.model == "mlp" else torch.nn.functional.cross_entropy
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
        numel = sum(p.numel() for p in runners[0]["model"].parameters())
        rows = []
        for r in runners:
            s = r["samples"]
            med = lambda f: statistics.median(f(v) for v in s)
            rows.append({"variant": r["name"], "step_s": med(lambda v: v[0] + v[1] + v[2]),
                         "forward_s": med(lambda v: v[0]), "backward_comm_s": med(lambda v: v[1]),
                         "optimizer_s": med(lambda v: v[2])})
        out.put({"parameters": numel, "rows": rows})
    dist.destroy_process_group()


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
    ap.add_argument("--port", type=int, default=29571)
    ap.add_argument("--variants", default="ddp,local")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.spawn(worker, args=(a, out), nprocs=a.world_size, join=True)
    res = out.get()
    rows = res["rows"]
    local = next((r["backward_comm_s"] for r in rows if r["variant"] == "local"), 0)
    what = (f"MLP {a.layers} x Linear({a.width},{a.width})+ReLU" if a.model == "mlp"
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
