"""The PyTorch peer of bench/generate.ts: greedy generation with a key/value cache, written the way a
PyTorch user would (each layer's keys and values grow by torch.cat), on flotilla's weights.

argv: weights.safetensors '<json config>' '<json prompt ids>' new_tokens rounds. Prints one JSON line
{"tokens": [...], "seconds": [wall per round], "cpu": [CPU time per round]}."""
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


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        C = c['nEmbd']
        self.nh = c['nHead']
        self.ln1 = nn.LayerNorm(C)
        self.qkv = nn.Linear(C, 3 * C)
        self.proj = nn.Linear(C, C)
        self.ln2 = nn.LayerNorm(C)
        self.fc = nn.Linear(C, 4 * C)
        self.fc2 = nn.Linear(4 * C, C)

    def forward(self, x, cache):
        B, T, C = x.shape
        hs = C // self.nh
        q, k, v = self.qkv(self.ln1(x)).split(C, 2)
        q, k, v = (t.view(B, T, self.nh, hs).transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            k = torch.cat([cache[0], k], 2)
            v = torch.cat([cache[1], v], 2)
        a = (q @ k.transpose(-2, -1)) * (1 / math.sqrt(hs))
        if T > 1:
            a = a.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float('-inf'))
        y = (a.softmax(-1) @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)))), (k, v)


class GPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte = nn.Embedding(c['vocabSize'], c['nEmbd'])
        self.wpe = nn.Embedding(c['blockSize'], c['nEmbd'])
        self.layers = nn.ModuleList([Block(c) for _ in range(c['nLayer'])])
        self.lnF = nn.LayerNorm(c['nEmbd'])
        self.head = nn.Linear(c['nEmbd'], c['vocabSize'], bias=False)

    def forward(self, idx, start, caches):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(start, start + T))
        new = []
        for i, b in enumerate(self.layers):
            x, kv = b(x, caches[i] if caches else None)
            new.append(kv)
        return self.head(self.lnF(x)), new


def main():
    tensors, _ = load(sys.argv[1])
    c = json.loads(sys.argv[2])
    prompt = json.loads(sys.argv[3])
    n, rounds = int(sys.argv[4]), int(sys.argv[5])
    model = GPT(c).eval()
    names = {k: k for k in tensors}
    renamed = {}
    for k, v in tensors.items():  # flotilla: layers.i.attn.qkv / attn.proj / mlp.fc / mlp.proj
        k2 = k.replace('.attn.qkv.', '.qkv.').replace('.attn.proj.', '.proj.').replace('.mlp.fc.', '.fc.').replace('.mlp.proj.', '.fc2.')
        renamed[k2] = v
    model.load_state_dict(renamed, strict=True)
    del names
    seconds, cpu, tokens = [], [], []
    with torch.no_grad():
        for _ in range(rounds):
            t0 = time.perf_counter()
            c0 = time.process_time()
            ids = torch.tensor([prompt])
            logits, caches = model(ids, 0, None)
            out = []
            pos = len(prompt)
            for _ in range(n):
                t = int(logits[0, -1].argmax())
                out.append(t)
                logits, caches = model(torch.tensor([[t]]), pos, caches)
                pos += 1
            seconds.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            tokens = out
    print(json.dumps({'tokens': tokens, 'seconds': seconds, 'cpu': cpu, 'torch': torch.__version__}), flush=True)


main()
