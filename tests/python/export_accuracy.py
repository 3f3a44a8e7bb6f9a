"""Loads a `crowdgrad export` file with safetensors.numpy and prints its MNIST test accuracy.

usage: python export_accuracy.py MODEL.safetensors MNIST_DIR

Only numpy and safetensors: the forward pass of crowdgrad's MLP (ReLU hidden layers, softmax
on top; `layer{i}.weight` is [fan_in, fan_out], `layer{i}.bias` is [fan_out]) on the test IDX
files (raw or .gz), pixels as p / 255 then the run's normalisation. Prints one JSON line:
{"accuracy": ..., "examples": ..., "tensors": {...shapes...}}.
"""

import gzip
import json
import os
import struct
import sys

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file


def idx(path):
    if not os.path.exists(path) and os.path.exists(path + ".gz"):
        path += ".gz"
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    zero, dtype, ndim = struct.unpack(">HBB", data[:4])
    assert zero == 0 and dtype == 0x08, "unsigned-byte IDX expected"
    dims = struct.unpack(">" + "I" * ndim, data[4 : 4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def main():
    model_path, mnist = sys.argv[1], sys.argv[2]
    tensors = load_file(model_path)
    with safe_open(model_path, framework="numpy") as f:
        meta = f.metadata()
    assert meta["format"] == "crowdgrad-model", meta.get("format")
    run = json.loads(meta["run"])
    images = idx(os.path.join(mnist, "t10k-images-idx3-ubyte"))
    labels = idx(os.path.join(mnist, "t10k-labels-idx1-ubyte"))
    x = images.reshape(images.shape[0], -1).astype(np.float32) * np.float32(1.0 / 255.0)
    norm = run.get("normalize") or {}
    mean, std = norm.get("mean") or [], norm.get("std") or []
    if mean:
        # One channel (MNIST): one value for every pixel.
        x = (x - np.float32(mean[0])) / np.float32(std[0])
    layers = len([k for k in tensors if k.endswith(".weight")])
    h = x
    for i in range(layers):
        h = h @ tensors[f"layer{i}.weight"] + tensors[f"layer{i}.bias"]
        if i < layers - 1:
            h = np.maximum(h, 0.0)
    accuracy = float((h.argmax(axis=1) == labels).mean())
    print(
        json.dumps(
            {
                "accuracy": accuracy,
                "examples": int(labels.shape[0]),
                "tensors": {k: list(v.shape) for k, v in sorted(tensors.items())},
                "versions": json.loads(meta["versions"]),
            }
        )
    )


if __name__ == "__main__":
    main()
