#!/usr/bin/env python3
"""Relative RMS between two `run-model --dump-logits` files, per position (median, max) and
overall: python3 bench/compare-logits.py REFERENCE.json OTHER.json [LABEL [--positions]]"""
import json
import sys

import numpy as np

a = np.array(json.load(open(sys.argv[1]))["logits"], dtype=np.float64)
b = np.array(json.load(open(sys.argv[2]))["logits"], dtype=np.float64)
d = b - a
per = np.sqrt((d**2).sum(1) / (a**2).sum(1))
label = sys.argv[3] if len(sys.argv) > 3 else sys.argv[2]
print(f"{label:40} median {np.median(per):.3e}  max {per.max():.3e}  first bad position "
      f"{int(np.argmax(per > 1e-3)) if (per > 1e-3).any() else -1}")
if len(sys.argv) > 4 and sys.argv[4] == "--positions":
    print("  per position: " + " ".join(f"{x:.1e}" for x in per))
