"""LoRA oracle: a Llama or a GPT written functionally here, in float64, whose adapted projections are
nn.Linear layers with a frozen base plus their own A and B (PEFT's definition, y = W x + b + s B(A(x))).

argv: in.safetensors (parameters by flotilla name, '<path>.loraA.weight' / '<path>.loraB.weight' for
each adapted Linear, 'idx', 'targets') out.safetensors json-config (the model config, "arch", "scale",
"adapted": list of module paths, for a Llama "invFreq"). Writes 'loss', 'logits', and 'grad.<name>'
for every adapter parameter; raises if a base parameter received a gradient."""
import json
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from st import load, save

torch.set_num_threads(1)


class LoraLinear(nn.Module):
    def __init__(self, weight, bias, A, B, scale):
        super().__init__()
        self.base = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=torch.float64)
        with torch.no_grad():
            self.base.weight.copy_(weight)
            if bias is not None:
                self.base.bias.copy_(bias)
        self.base.requires_grad_(False)
        self.A = nn.Parameter(A.clone())  # (r, in)
        self.B = nn.Parameter(B.clone())  # (out, r)
        self.scale = scale

    def forward(self, x):
        return self.base(x) + self.scale * ((x @ self.A.t()) @ self.B.t())


def build(P, cfg):
    """Every Linear of the model by module path: a LoraLinear where adapted, a frozen nn.Linear elsewhere."""
    layers = {}
    for name in P:
        if name.endswith('.loraA.weight'):
            path = name[: -len('.loraA.weight')]
            layers[path] = LoraLinear(P[path + '.weight'], P.get(path + '.bias'), P[name], P[path + '.loraB.weight'], cfg['scale'])
    assert sorted(layers) == sorted(cfg['adapted']), (sorted(layers), cfg['adapted'])

    def lin(path, x):
        if path in layers:
            return layers[path](x)
        return F.linear(x, P[path + '.weight'], P.get(path + '.bias'))
    return lin, layers


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def llama(P, lin, idx, c):
    B, T = idx.shape
    nh, nkv, hd = c['nHead'], c['nKvHead'], c['headDim']
    inv = torch.tensor(c['invFreq'], dtype=torch.float64)
    ang = torch.outer(torch.arange(T, dtype=torch.float64), inv)
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()

    def rope(t):
        t1, t2 = t[..., : hd // 2], t[..., hd // 2:]
        return t * cos + torch.cat((-t2, t1), -1) * sin
    mask = torch.full((T, T), float('-inf'), dtype=torch.float64).triu(1)
    x = F.embedding(idx, P['wte.weight'])
    for i in range(c['nLayer']):
        f = f'layers.{i}.'
        h = rms(x, P[f + 'attnNorm.weight'], c['rmsNormEps'])
        q = rope(lin(f + 'attn.q', h).view(B, T, nh, hd).transpose(1, 2))
        k = rope(lin(f + 'attn.k', h).view(B, T, nkv, hd).transpose(1, 2)).repeat_interleave(nh // nkv, 1)
        v = lin(f + 'attn.v', h).view(B, T, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, 1)
        att = ((q @ k.transpose(-2, -1)) / math.sqrt(hd) + mask).softmax(-1)
        x = x + lin(f + 'attn.o', (att @ v).transpose(1, 2).reshape(B, T, nh * hd))
        h = rms(x, P[f + 'mlpNorm.weight'], c['rmsNormEps'])
        x = x + lin(f + 'mlp.down', F.silu(lin(f + 'mlp.gate', h)) * lin(f + 'mlp.up', h))
    x = rms(x, P['norm.weight'], c['rmsNormEps'])
    return F.linear(x, P['wte.weight']) if c['tieEmbeddings'] else lin('head', x)


def gpt(P, lin, idx, c):
    B, T = idx.shape
    C, nh = c['nEmbd'], c['nHead']
    hs = C // nh
    g = (lambda t: F.gelu(t, approximate='tanh')) if c['gelu'] == 'tanh' else F.gelu
    mask = torch.full((T, T), float('-inf'), dtype=torch.float64).triu(1)
    x = F.embedding(idx, P['wte.weight']) + F.embedding(torch.arange(T), P['wpe.weight'])
    for i in range(c['nLayer']):
        f = f'layers.{i}.'
        h = F.layer_norm(x, (C,), P[f + 'ln1.weight'], P.get(f + 'ln1.bias'), 1e-5)
        q, k, v = (t.view(B, T, nh, hs).transpose(1, 2) for t in lin(f + 'attn.qkv', h).split(C, dim=2))
        att = ((q @ k.transpose(-2, -1)) / math.sqrt(hs) + mask).softmax(-1)
        x = x + lin(f + 'attn.proj', (att @ v).transpose(1, 2).reshape(B, T, C))
        h = F.layer_norm(x, (C,), P[f + 'ln2.weight'], P.get(f + 'ln2.bias'), 1e-5)
        x = x + lin(f + 'mlp.proj', g(lin(f + 'mlp.fc', h)))
    x = F.layer_norm(x, (C,), P['lnF.weight'], P.get('lnF.bias'), 1e-5)
    return F.linear(x, P['wte.weight']) if c['tieEmbeddings'] else lin('head', x)


def main():
    inputs, _ = load(sys.argv[1])
    c = json.loads(sys.argv[3])
    P = {k: v.to(torch.float64) for k, v in inputs.items() if k not in ('idx', 'targets')}
    lin, layers = build(P, c)
    logits = (llama if c['arch'] == 'llama' else gpt)(P, lin, inputs['idx'], c)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), inputs['targets'].reshape(-1))
    loss.backward()
    assert all(p.grad is None for p in P.values()), 'a base parameter received a gradient'
    out = {'loss': loss.detach().reshape(1), 'logits': logits.detach()}
    for path, m in layers.items():
        assert m.base.weight.grad is None
        out[f'grad.{path}.loraA.weight'] = m.A.grad
        out[f'grad.{path}.loraB.weight'] = m.B.grad
    save(sys.argv[2], out)


main()
