"""torch.optim.AdamW / SGD on given parameters and a given gradient sequence.

argv: in.safetensors out.safetensors json. Inputs: 'p.<i>' initial parameters, 'g.<step>.<i>' the gradient of
parameter i at step (absent: that parameter has no gradient that step, as when it took no part).
json: {"optimizer": "adamw" | "sgd", "groups": [{"params": [i, ...], "options": {...flotilla option names}}],
       "steps": n, "lrs": [per-step lr] (optional)}.
Writes 'p.<step>.<i>': every parameter after every step."""
import json
import sys

import torch

from st import load, save

torch.set_num_threads(1)
inputs, _ = load(sys.argv[1])
cfg = json.loads(sys.argv[3])
n = sum(1 for k in inputs if k.startswith('p.'))
params = [inputs[f'p.{i}'].clone() for i in range(n)]


def torch_options(o):
    if cfg['optimizer'] == 'adamw':
        return {'lr': o['lr'], 'betas': tuple(o['betas']), 'eps': o['eps'], 'weight_decay': o['weightDecay']}
    return {'lr': o['lr'], 'momentum': o['momentum'], 'dampening': o['dampening'], 'weight_decay': o['weightDecay'],
            'nesterov': o['nesterov']}


groups = [{'params': [params[i] for i in g['params']], **torch_options(g['options'])} for g in cfg['groups']]
opt = torch.optim.AdamW(groups) if cfg['optimizer'] == 'adamw' else torch.optim.SGD(groups, lr=groups[0]['lr'])
out = {}
for s in range(cfg['steps']):
    if 'lrs' in cfg:
        for g in opt.param_groups:
            g['lr'] = cfg['lrs'][s]
    for i, p in enumerate(params):
        p.grad = inputs.get(f'g.{s}.{i}')
    opt.step()
    for i, p in enumerate(params):
        out[f'p.{s}.{i}'] = p.clone()
save(sys.argv[2], out)
