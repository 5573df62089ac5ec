#!/usr/bin/env python3
"""Traces torchvision's ResNet-50 (random weights, training mode: BatchNorm on batch statistics)
at an input of 3 x SIZE x SIZE and saves it as TorchScript, so that bench_torch (torch::jit::load)
and ddp_gloo.py (torch.jit.load) train the identical module.

Run: /usr/bin/python3 bench/torch/export_resnet50.py OUT.pt [SIZE=64]
"""
import sys

import torch
import torchvision

out = sys.argv[1]
size = int(sys.argv[2]) if len(sys.argv) > 2 else 64
torch.manual_seed(0)
m = torchvision.models.resnet50(weights=None)
m.train()
traced = torch.jit.trace(m, torch.randn(2, 3, size, size), check_trace=False)
traced.save(out)
print(f"{out}: ResNet-50 at {size}x{size}, {sum(p.numel() for p in m.parameters()) / 1e6:.2f} M parameters")
