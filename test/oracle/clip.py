"""torch.nn.utils.clip_grad_norm_ over the whole model's gradients.

argv: in.safetensors out.safetensors json. Inputs: 'g.<name>' every parameter's gradient (float32 or float64).
json: {"maxNorm": float, "norms": [p, ...], "float64": bool} with p a number or "inf". For each p, on a fresh copy of
the gradients (converted to float64 first when "float64" is true): writes 'norm.<p>' (the returned total norm,
float64 scalar) and 'g.<p>.<name>' (the clipped gradients).

Why "float64": PyTorch 1.13's own float32 norm of one long tensor is not accurate (one thread, 6M elements of
randn * 1e-3: relative error 2.6e-3 for p=1 and 1.7e-4 for p=2 against the float64 norm of the same values), so
a test at millions of elements compares with clip_grad_norm_ on float64 copies of the same gradients."""
import json
import sys

import torch

from st import load, save

torch.set_num_threads(1)
inputs, _ = load(sys.argv[1])
cfg = json.loads(sys.argv[3])
names = [k[2:] for k in inputs if k.startswith('g.')]
out = {}
for p in cfg['norms']:
    norm_type = float('inf') if p == 'inf' else float(p)
    params = []
    for n in names:
        g = inputs['g.' + n]
        if cfg.get('float64'):
            g = g.double()
        t = torch.zeros_like(g, requires_grad=True)
        t.grad = g.clone()
        params.append(t)
    total = torch.nn.utils.clip_grad_norm_(params, cfg['maxNorm'], norm_type=norm_type)
    out[f'norm.{p}'] = total.detach().to(torch.float64).reshape(1)
    for n, t in zip(names, params):
        out[f'g.{p}.{n}'] = t.grad
save(sys.argv[2], out)
