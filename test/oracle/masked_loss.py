"""The global loss reduction written plainly in PyTorch: one GPT (on flotilla's parameter names) on a
whole global batch whose targets are partly ignored (-100), the loss being the sum of the
cross-entropy over every trained target divided by their number, and its gradients. Also the mean
of per-micro-batch means (over the micro-batches holding a trained target), which it must differ from.

argv: in.safetensors out.safetensors json-config. Inputs: parameters by flotilla name, 'idx' (R, T),
'targets' (R, T); config: the GPT's fields and 'micro' (micro-batches of the global batch, rows in
order). Writes 'loss', 'count', 'meanOfMeans' and 'grad.<name>' for every parameter."""
import json
import math
import sys

import torch
import torch.nn.functional as F

from st import load, save

torch.set_num_threads(1)
IGNORE = -100


def logits_of(P, idx, cfg):
    B, T = idx.shape
    C, nh = cfg['nEmbd'], cfg['nHead']
    hs = C // nh
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    x = P['wte.weight'][idx] + P['wpe.weight'][torch.arange(T)]
    for i in range(cfg['nLayer']):
        def p(n):
            return P.get(f'layers.{i}.{n}')
        h = F.layer_norm(x, (C,), p('ln1.weight'), p('ln1.bias'), 1e-5)
        qkv = h @ p('attn.qkv.weight').t() + p('attn.qkv.bias')
        q, k, v = (t.reshape(B, T, nh, hs).transpose(1, 2) for t in qkv.split(C, dim=2))
        a = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
        a = torch.where(causal, a, torch.tensor(float('-inf'), dtype=a.dtype)).softmax(-1)
        y = (a @ v).transpose(1, 2).reshape(B, T, C)
        x = x + y @ p('attn.proj.weight').t() + p('attn.proj.bias')
        h = F.layer_norm(x, (C,), p('ln2.weight'), p('ln2.bias'), 1e-5)
        x = x + F.gelu(h @ p('mlp.fc.weight').t() + p('mlp.fc.bias')) @ p('mlp.proj.weight').t() + p('mlp.proj.bias')
    x = F.layer_norm(x, (C,), P['lnF.weight'], P.get('lnF.bias'), 1e-5)
    head = P['wte.weight'] if cfg['tieEmbeddings'] else P['head.weight']
    return x @ head.t()


def main():
    inputs, _ = load(sys.argv[1])
    cfg = json.loads(sys.argv[3])
    idx, targets = inputs['idx'], inputs['targets']
    P = {k: v.clone().requires_grad_(True) for k, v in inputs.items() if k not in ('idx', 'targets')}
    logits = logits_of(P, idx, cfg)
    V = logits.shape[-1]
    # Token by token: each trained target's -log softmax, summed; the count is theirs.
    total = torch.zeros((), dtype=logits.dtype)
    count = 0
    per_micro = []
    rows = idx.shape[0] // cfg['micro']
    for m in range(cfg['micro']):
        s, n = torch.zeros((), dtype=logits.dtype), 0
        for r in range(m * rows, (m + 1) * rows):
            for t in range(idx.shape[1]):
                y = int(targets[r, t])
                if y == IGNORE:
                    continue
                s = s - torch.log_softmax(logits[r, t].reshape(1, V), -1)[0, y]
                n += 1
        total = total + s
        count += n
        if n > 0:
            per_micro.append(s.detach() / n)
    loss = total / count
    loss.backward()
    out = {'loss': loss.detach().reshape(1), 'count': torch.tensor([float(count)], dtype=torch.float64),
           'meanOfMeans': torch.stack(per_micro).mean().reshape(1)}
    out.update({'grad.' + k: v.grad for k, v in P.items()})
    save(sys.argv[2], out)


main()
