"""Reads a safetensors file written by flotilla and writes back, for every tensor, its values as float64
(or int64), plus a few checks done in PyTorch: argv in.safetensors out.safetensors."""
import json
import sys

import torch

from st import load, save

tensors, meta = load(sys.argv[1])
out = {}
for name, t in tensors.items():
    wide = t.double() if t.is_floating_point() else t.long()
    out['value.' + name] = wide
    out['sum.' + name] = wide.sum().reshape(1)
save(sys.argv[2], out, {'names': json.dumps(list(tensors)), 'dtypes': json.dumps([str(t.dtype) for t in tensors.values()]),
                        'shapes': json.dumps([list(t.shape) for t in tensors.values()]), 'meta': json.dumps(meta)})
