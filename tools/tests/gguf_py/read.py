"""Reads a GGUF file with llama.cpp's own Python package (gguf-py) and prints, as JSON, what it
sees: every metadata key with its type, and for every tensor its name, ggml type, ne, byte size
and the dequantized values' first 16, sum and sum of squares (float64)."""
import json
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

reader = GGUFReader(sys.argv[1])
keys = {}
for name, field in reader.fields.items():
    if name.startswith("GGUF."):
        continue
    keys[name] = [int(t) for t in field.types]
tensors = []
for t in reader.tensors:
    values = dequantize(t.data, t.tensor_type).astype(np.float64).ravel()
    tensors.append({
        "name": t.name,
        "type": t.tensor_type.name,
        "ne": [int(x) for x in t.shape],
        "n_bytes": int(t.n_bytes),
        "first": [float(x) for x in values[:16]],
        "sum": float(values.sum()),
        "sumsq": float((values * values).sum()),
    })
print(json.dumps({"alignment": reader.alignment, "keys": keys, "tensors": tensors}))
