"""Packed documents, the slow obvious way: every document of every row run ALONE through a plain
PyTorch GPT (learned positions) or Llama (rotary, grouped-query), at positions 0 .. L-1 with an
ordinary causal mask, and the per-document logits put back where the document sits in its row.

argv: in.safetensors out.safetensors json-config.
Inputs: the parameters by flotilla name (float32 or float64; the run uses their dtype), 'idx' (B, T)
token ids, 'ids' (B, T) each token's document number within its row, 'w' (B, T, V) weights.
Config: {"arch": "gpt" | "llama", and the model's resolved config fields}.
Writes 'logits' (B, T, V) and 'grad.<name>' of sum over documents of sum(logits_doc * w_doc)."""
import json
import math
import sys

import torch
import torch.nn.functional as F

from st import load, save

torch.set_num_threads(1)


def gpt(P, idx, c):
    T = idx.shape[0]
    C, nh = c['nEmbd'], c['nHead']
    hs = C // nh
    x = P['wte.weight'][idx] + P['wpe.weight'][:T]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(c['nLayer']):
        p = lambda n: P.get(f'layers.{i}.{n}')  # noqa: E731
        h = F.layer_norm(x, (C,), p('ln1.weight'), p('ln1.bias'), 1e-5)
        q, k, v = (t.reshape(T, nh, hs).transpose(0, 1) for t in F.linear(h, p('attn.qkv.weight'), p('attn.qkv.bias')).split(C, dim=-1))
        a = (q @ k.transpose(-1, -2)) / math.sqrt(hs)
        a = torch.where(causal, a, torch.tensor(float('-inf'), dtype=a.dtype)).softmax(-1)
        x = x + F.linear((a @ v).transpose(0, 1).reshape(T, C), p('attn.proj.weight'), p('attn.proj.bias'))
        h = F.layer_norm(x, (C,), p('ln2.weight'), p('ln2.bias'), 1e-5)
        x = x + F.linear(F.gelu(F.linear(h, p('mlp.fc.weight'), p('mlp.fc.bias'))), p('mlp.proj.weight'), p('mlp.proj.bias'))
    x = F.layer_norm(x, (C,), P['lnF.weight'], P.get('lnF.bias'), 1e-5)
    return F.linear(x, P['wte.weight'] if c['tieEmbeddings'] else P['head.weight'])


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def llama(P, idx, c):
    T = idx.shape[0]
    hd, nh, nkv = c['headDim'], c['nHead'], c['nKvHead']
    dt = P['wte.weight'].dtype
    # The frequencies are float32 numbers (as transformers makes them); the angles are taken in the
    # model's dtype.
    f32 = lambda v: float(torch.tensor(v, dtype=torch.float32))  # noqa: E731
    inv = [f32(1.0 / f32(c['ropeTheta'] ** f32(2 * i / hd))) for i in range(hd // 2)]
    ang = torch.arange(T, dtype=dt)[:, None] * torch.tensor(inv, dtype=dt)[None, :]
    ang = torch.cat([ang, ang], -1)  # (T, hd)
    cos, sin = ang.cos(), ang.sin()

    def rope(t):  # (n, T, hd)
        h = hd // 2
        return t * cos + torch.cat([-t[..., h:], t[..., :h]], -1) * sin

    x = P['wte.weight'][idx]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(c['nLayer']):
        p = lambda n: P[f'layers.{i}.{n}']  # noqa: E731
        h = rms(x, p('attnNorm.weight'), c['rmsNormEps'])
        q = rope(F.linear(h, p('attn.q.weight')).reshape(T, nh, hd).transpose(0, 1))
        k = rope(F.linear(h, p('attn.k.weight')).reshape(T, nkv, hd).transpose(0, 1))
        v = F.linear(h, p('attn.v.weight')).reshape(T, nkv, hd).transpose(0, 1)
        k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        a = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        a = torch.where(causal, a, torch.tensor(float('-inf'), dtype=a.dtype)).softmax(-1)
        x = x + F.linear((a @ v).transpose(0, 1).reshape(T, nh * hd), p('attn.o.weight'))
        h = rms(x, p('mlpNorm.weight'), c['rmsNormEps'])
        x = x + F.linear(F.silu(F.linear(h, p('mlp.gate.weight'))) * F.linear(h, p('mlp.up.weight')), p('mlp.down.weight'))
    x = rms(x, P['norm.weight'], c['rmsNormEps'])
    return F.linear(x, P['wte.weight'] if c['tieEmbeddings'] else P['head.weight'])


def main():
    inputs, _ = load(sys.argv[1])
    c = json.loads(sys.argv[3])
    idx, ids, w = inputs.pop('idx'), inputs.pop('ids'), inputs.pop('w')
    P = {k: v.clone().requires_grad_(True) for k, v in inputs.items()}
    run = gpt if c['arch'] == 'gpt' else llama
    B, T = idx.shape
    logits = torch.zeros(B, T, w.shape[-1], dtype=w.dtype)
    total = 0
    for b in range(B):
        for d in ids[b].unique().tolist():
            where = (ids[b] == d).nonzero().flatten()
            s, e = int(where[0]), int(where[-1]) + 1
            out = run(P, idx[b, s:e], c)
            logits[b, s:e] = out.detach()
            total = total + (out * w[b, s:e]).sum()
    total.backward()
    res = {'logits': logits}
    res.update({'grad.' + n: p.grad for n, p in P.items()})
    save(sys.argv[2], res)


main()
