"""The PyTorch peer of bench/step.ts: the same GPT training step, written the way a PyTorch user would.

Run by bench/step.ts (not on its own): argv init.safetensors '<json config>'. It loads flotilla's initial
weights and batch, prints one JSON line {"ready", "loss0"}, then answers each stdin line {"steps": n, "mode": "fp32" | "bf16" (torch.autocast)} with
one JSON line {"times": [seconds per step]}; an empty line or EOF ends it."""
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'test', 'oracle'))
from st import load  # noqa: E402

torch.set_num_threads(1)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.nh, self.C = c['nHead'], c['nEmbd']
        self.qkv = nn.Linear(self.C, 3 * self.C, bias=c['bias'])
        self.proj = nn.Linear(self.C, self.C, bias=c['bias'])
        self.register_buffer('mask', torch.ones(c['blockSize'], c['blockSize'], dtype=torch.bool).tril())

    def forward(self, x):
        B, T, C = x.shape
        hs = C // self.nh
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.nh, hs).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        att = att.masked_fill(~self.mask[:T, :T], float('-inf')).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.fc = nn.Linear(c['nEmbd'], 4 * c['nEmbd'], bias=c['bias'])
        self.proj = nn.Linear(4 * c['nEmbd'], c['nEmbd'], bias=c['bias'])

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln1 = nn.LayerNorm(c['nEmbd'], elementwise_affine=True)
        self.attn = Attention(c)
        self.ln2 = nn.LayerNorm(c['nEmbd'], elementwise_affine=True)
        self.mlp = MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.wte = nn.Embedding(c['vocabSize'], c['nEmbd'])
        self.wpe = nn.Embedding(c['blockSize'], c['nEmbd'])
        self.layers = nn.ModuleList([Block(c) for _ in range(c['nLayer'])])
        self.lnF = nn.LayerNorm(c['nEmbd'])
        self.head = nn.Linear(c['nEmbd'], c['vocabSize'], bias=False)
        if c['tieEmbeddings']:
            self.head.weight = self.wte.weight

    def forward(self, idx, targets):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T))
        for b in self.layers:
            x = b(x)
        logits = self.head(self.lnF(x))
        return F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T))


def main():
    tensors, _ = load(sys.argv[1])
    c = json.loads(sys.argv[2])
    model = GPT(c)
    # flotilla's names are this module's names; bias-free LayerNorms are not modelled here (bias: true).
    missing, unexpected = model.load_state_dict({k: v for k, v in tensors.items() if k not in ('idx', 'targets')}, strict=False)
    missing = [k for k in missing if not k.endswith('.mask') and not (c['tieEmbeddings'] and k == 'head.weight')]
    if missing or unexpected:
        raise SystemExit(f'weights do not match: missing {missing}, unexpected {unexpected}')
    idx, targets = tensors['idx'], tensors['targets']
    o = c['adamw']
    opt = torch.optim.AdamW(model.parameters(), lr=o['lr'], betas=tuple(o['betas']), eps=o['eps'], weight_decay=o['weightDecay'])

    def step(mode):
        c0 = time.process_time()
        t0 = time.perf_counter()
        opt.zero_grad()
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=(mode == 'bf16')):
            loss = model(idx, targets)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        loss.item()
        t3 = time.perf_counter()
        return [t1 - t0, t2 - t1, t3 - t2, time.process_time() - c0]

    with torch.no_grad():
        loss0 = model(idx, targets).item()
    print(json.dumps({'ready': True, 'loss0': loss0, 'torch': torch.__version__, 'threads': torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        req = json.loads(line)
        times = [step(req.get('mode', 'fp32')) for _ in range(req['steps'])]
        print(json.dumps({'times': times}), flush=True)


if __name__ == '__main__':
    main()
