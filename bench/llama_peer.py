"""The PyTorch reference Llama, written as transformers' LlamaForCausalLM computes it (eager attention:
RMSNorm in float32, rotary tables in float32 with autocast off, rotate_half, repeat_kv, scores plus an
additive causal mask, softmax in float32), on flotilla's parameter names (src/models/llama.ts), so
flotilla's weights load as they are. Used by bench/llama.ts (its step-time peer) and by the Llama
tests (test/fixtures/llama_torch.py).

As the benchmark peer: argv init.safetensors '<json config>' (resolved LlamaConfig fields, 'adamw', and
optionally 'lora': {rank, alpha}: a LoRA layer around every Linear but the head, the base frozen, A and
B loaded from flotilla's '<linear>.loraA.weight' and '<linear>.loraB.weight').
Prints {"ready", "loss0", "logits0" (the first sequence's first 16 positions' logits, flat)}, then answers each stdin line {"steps": n, "mode": "fp32" | "bf16"} with
{"times": [seconds per step], "cpu": [CPU seconds per step]}; an empty line ends it."""
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def inv_frequencies(c):
    d = c['headDim']
    inv = 1.0 / (c['ropeTheta'] ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if c.get('ropeScaling', 'none') != 'llama3':
        return inv
    # transformers' _compute_llama3_parameters
    factor, lo, hi, old = c['ropeFactor'], c['ropeLowFreqFactor'], c['ropeHighFreqFactor'], c['ropeOriginalMaxPositions']
    low_wavelen, high_wavelen = old / lo, old / hi
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32) if dtype != torch.float64 else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        C, hd = c['nEmbd'], c['headDim']
        self.nh, self.nkv, self.hd = c['nHead'], c['nKvHead'], hd
        self.q = nn.Linear(C, self.nh * hd, bias=False)
        self.k = nn.Linear(C, self.nkv * hd, bias=False)
        self.v = nn.Linear(C, self.nkv * hd, bias=False)
        self.o = nn.Linear(self.nh * hd, C, bias=False)

    def forward(self, x, cos, sin, mask):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        g = self.nh // self.nkv  # repeat_kv
        k = k[:, :, None].expand(B, self.nkv, g, T, self.hd).reshape(B, self.nh, T, self.hd)
        v = v[:, :, None].expand(B, self.nkv, g, T, self.hd).reshape(B, self.nh, T, self.hd)
        att = torch.matmul(q, k.transpose(2, 3)) * (1.0 / math.sqrt(self.hd)) + mask
        att = F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
        y = torch.matmul(att, v).transpose(1, 2).reshape(B, T, self.nh * self.hd)
        return self.o(y)


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        C, I = c['nEmbd'], c['intermediateSize']
        self.gate = nn.Linear(C, I, bias=False)
        self.up = nn.Linear(C, I, bias=False)
        self.down = nn.Linear(I, C, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.attnNorm = RMSNorm(c['nEmbd'], c['rmsNormEps'])
        self.attn = Attention(c)
        self.mlpNorm = RMSNorm(c['nEmbd'], c['rmsNormEps'])
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.attnNorm(x), cos, sin, mask)
        return x + self.mlp(self.mlpNorm(x))


class Llama(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.wte = nn.Embedding(c['vocabSize'], c['nEmbd'])
        self.layers = nn.ModuleList([Block(c) for _ in range(c['nLayer'])])
        self.norm = RMSNorm(c['nEmbd'], c['rmsNormEps'])
        self.tied = c['tieEmbeddings']
        if not self.tied:
            self.head = nn.Linear(c['nEmbd'], c['vocabSize'], bias=False)
        self.register_buffer('inv_freq', inv_frequencies(c), persistent=False)

    def logits(self, idx):
        B, T = idx.shape
        x = self.wte(idx)
        with torch.autocast('cpu', enabled=False):  # rotary tables in float32, as transformers' LlamaRotaryEmbedding
            freqs = torch.outer(torch.arange(T).float(), self.inv_freq.float())
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        mask = torch.full((T, T), float('-inf'), dtype=x.dtype).triu(1)
        for b in self.layers:
            x = b(x, cos, sin, mask)
        x = self.norm(x)
        return F.linear(x, self.wte.weight if self.tied else self.head.weight)

    def forward(self, idx, targets):
        logits = self.logits(idx)
        return logits, F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


class LoraLinear(nn.Module):
    """A low-rank adapter around a frozen nn.Linear: y = W x + alpha / r * B(A(x)), A (r, in) and B (out, r)."""

    def __init__(self, base, r, alpha):
        super().__init__()
        self.base = base
        self.base.weight.requires_grad_(False)
        self.loraA = nn.Linear(base.in_features, r, bias=False)
        self.loraB = nn.Linear(r, base.out_features, bias=False)
        nn.init.zeros_(self.loraB.weight)
        self.scale = alpha / r

    def forward(self, x):
        return self.base(x) + self.loraB(self.loraA(x)) * self.scale


def add_lora(model, tensors, r, alpha):
    """Wraps every Linear but the head in a LoraLinear, freezes every other parameter, and loads the adapters."""
    for p in model.parameters():
        p.requires_grad_(False)
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and name != 'head']
    for name, m in targets:
        parent, _, leaf = name.rpartition('.')
        setattr(model.get_submodule(parent), leaf, LoraLinear(m, r, alpha))
    adapters = {}
    for name, _ in targets:
        for ab in ('loraA', 'loraB'):
            adapters[f'{name}.{ab}.weight'] = tensors[f'{name}.{ab}.weight']
    missing, unexpected = model.load_state_dict(adapters, strict=False)
    assert not unexpected and all('.lora' not in k for k in missing), (missing, unexpected)
    return [p for p in model.parameters() if p.requires_grad]


def load_model(tensors, c):
    model = Llama(c)
    own = set(model.state_dict().keys())
    model.load_state_dict({k: v for k, v in tensors.items() if k in own}, strict=True)
    return model


def main():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'test', 'oracle'))
    from st import load

    torch.set_num_threads(1)
    tensors, _ = load(sys.argv[1])
    c = json.loads(sys.argv[2])
    model = load_model(tensors, c)
    trained = add_lora(model, tensors, c['lora']['rank'], c['lora']['alpha']) if 'lora' in c else list(model.parameters())
    idx, targets = tensors['idx'], tensors['targets']
    o = c['adamw']
    opt = torch.optim.AdamW(trained, lr=o['lr'], betas=tuple(o['betas']), eps=o['eps'], weight_decay=o['weightDecay'])

    def step(mode):
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=(mode == 'bf16')):
            _, loss = model(idx, targets)
        loss.backward()
        opt.step()
        loss.item()
        return time.perf_counter() - t0, time.process_time() - c0

    with torch.no_grad():
        logits, loss0 = model(idx, targets)
    logits0 = logits[0, :16].reshape(-1).tolist()
    print(json.dumps({'ready': True, 'loss0': loss0.item(), 'logits0': logits0, 'torch': torch.__version__}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        req = json.loads(line)
        ts = [step(req['mode']) for _ in range(req['steps'])]
        print(json.dumps({'times': [t for t, _ in ts], 'cpu': [c for _, c in ts]}), flush=True)


if __name__ == '__main__':
    main()
