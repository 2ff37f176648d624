# The GPT of the data-parallel benchmarks in PyTorch: the same math as src/models/gpt.ts at the
# benchmark size (V 256, T 128, 4 layers, 8 heads, width 256). Imported by the peer scripts.
import math
import torch
import torch.nn as nn
import torch.nn.functional as F

V, T, L, H, C = 256, 128, 4, 8, 256


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(C); self.qkv = nn.Linear(C, 3 * C); self.proj = nn.Linear(C, C)
        self.ln2 = nn.LayerNorm(C); self.fc = nn.Linear(C, 4 * C); self.fc2 = nn.Linear(4 * C, C)
        self.mask = torch.ones(T, T, dtype=torch.bool).tril()  # not a buffer: Gloo cannot broadcast bool

    def forward(self, x):
        B, t, _ = x.shape
        hs = C // H
        q, k, v = self.qkv(self.ln1(x)).split(C, 2)
        q, k, v = (z.view(B, t, H, hs).transpose(1, 2) for z in (q, k, v))
        a = (q @ k.transpose(-2, -1)) * (1 / math.sqrt(hs))
        a = a.masked_fill(~self.mask[:t, :t], float('-inf')).softmax(-1)
        x = x + self.proj((a @ v).transpose(1, 2).contiguous().view(B, t, C))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, C); self.wpe = nn.Embedding(T, C)
        self.h = nn.ModuleList([Block() for _ in range(L)])
        self.ln = nn.LayerNorm(C); self.head = nn.Linear(C, V, bias=False)

    def forward(self, idx, tgt):
        B, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for b in self.h:
            x = b(x)
        return F.cross_entropy(self.head(self.ln(x)).view(B * t, V), tgt.reshape(B * t))
