"""Round-trip latency of torch.distributed.rpc (TensorPipe), the reference bench_remote competes
with: an empty call and calls carrying a tensor of 1 KiB to 16 MiB, rank 0 calling rank 1, two
processes on this machine. Prints median microseconds per round trip.

Usage: /usr/bin/python3 bench/remote/torch_rpc.py [--reps N]   (Debian's python3-torch)
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp


def empty():
    return None


def echo(t):
    return t


def run(rank, reps):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.set_num_threads(1)
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=4, rpc_timeout=120)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        def timed(fn, args):
            for _ in range(min(20, reps)):
                rpc.rpc_sync("w1", fn, args=args)
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                rpc.rpc_sync("w1", fn, args=args)
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts) * 1e6
        print(f"torch {torch.__version__}, torch.distributed.rpc (TensorPipe), 2 processes, median of {reps}")
        print(f"| call | median us |\n|---|--:|\n| empty | {timed(empty, ()):.1f} |")
        for size in (1 << 10, 64 << 10, 1 << 20, 16 << 20):
            t = torch.zeros(size // 4)
            n = max(5, reps // (1 + size // (64 << 10)))
            us = timed(echo, (t,)) if n == reps else None
            if us is None:
                ts = []
                for _ in range(n):
                    t0 = time.perf_counter()
                    rpc.rpc_sync("w1", echo, args=(t,))
                    ts.append(time.perf_counter() - t0)
                us = statistics.median(ts) * 1e6
            print(f"| echo {size // 1024} KiB | {us:.1f} |")
    rpc.shutdown()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    mp.spawn(run, args=(a.reps,), nprocs=2, join=True)
