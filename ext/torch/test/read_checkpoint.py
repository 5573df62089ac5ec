"""Reads a lockstep::torch checkpoint in Python, as a PyTorch user would, and checks it.

Debian 12 has no python3-safetensors package, so this is the small reader a user writes: the
file is safetensors (8-byte little-endian header size, a JSON header, the tensors' bytes).
It loads the module's tensors into the same architecture with torch's load_state_dict (strict:
every name must match), runs the saved input through it and compares with the output the C++
side computed; and it checks Adam's state is there under optimizer.state.<param>.<field>.

Usage: read_checkpoint.py DIR   (DIR holds model.safetensors and io.safetensors)
"""
import json
import struct
import sys

import torch

DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
          "I32": torch.int32, "I64": torch.int64, "U8": torch.uint8}


def load_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    meta = header.pop("__metadata__", {})
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        t = torch.frombuffer(bytearray(body[begin:end]), dtype=DTYPES[info["dtype"]]) if end > begin else \
            torch.empty(0, dtype=DTYPES[info["dtype"]])
        out[name] = t.reshape(info["shape"])
    return out, meta


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def main():
    d = sys.argv[1]
    tensors, meta = load_safetensors(d + "/model.safetensors")
    io, _ = load_safetensors(d + "/io.safetensors")
    module = {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}
    net = Net()
    net.load_state_dict(module, strict=True)
    net.eval()
    with torch.no_grad():
        y = net(io["x"])
    diff = (y - io["y"]).abs().max().item()
    print(f"module tensors: {len(module)}, max |python - c++| = {diff:.3g}")
    assert diff < 1e-5, f"python output differs from the C++ one by {diff}"
    assert int(module["bn.num_batches_tracked"]) == 2, module["bn.num_batches_tracked"]
    for p in ("fc1.weight", "fc1.bias", "fc2.weight"):
        for field in ("exp_avg", "exp_avg_sq"):
            t = tensors[f"optimizer.state.{p}.{field}"]
            assert t.shape == module[p].shape, (p, field, t.shape)
        assert int(tensors[f"optimizer.state.{p}.step"]) == 2
    assert abs(float(tensors["optimizer.param_groups.0.lr"]) - 1e-2) < 1e-12
    assert meta.get("lockstep.torch.optimizer") == "Adam", meta
    print("python reads the lockstep::torch checkpoint: ok")


if __name__ == "__main__":
    main()
