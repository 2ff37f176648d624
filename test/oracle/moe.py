"""The mixture-of-experts oracle, written plainly in PyTorch on flotilla's parameter names: every token's
experts chosen by a Python sort (ties to the lower index), capacity counted token by token, each
expert applied to each of its tokens one at a time. No grouping, no index arithmetic shared with flotilla.

argv: in.safetensors out.safetensors json-config. config: {"what": "layer" | "gpt" | "llama", "moe": {...},
plus the model's fields}. Inputs: parameters by flotilla name (and '<layer>.expertBias' buffers), then
  layer: 'x' (B, T, C) and 'w' (B, T, C); the objective is sum(out * w) + auxCoeff * aux.
  gpt / llama: 'idx', 'targets'; the objective is cross-entropy + auxCoeff * (sum of the layers' aux).
Writes 'loss' (the objective without aux), 'aux' (summed over layers), 'out' (layer) or 'logits',
'grad.<name>' for every parameter, and 'grad.x' (layer)."""
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..', '..', 'bench'))
from st import load, save  # noqa: E402

torch.set_num_threads(1)


def expert(P, pre, e, v, kind):
    """One expert MLP on rows v (n, C)."""
    if kind == 'swiglu':
        return (F.silu(v @ P[pre + 'gate'][e]) * (v @ P[pre + 'up'][e])) @ P[pre + 'down'][e]
    h = v @ P[pre + 'fc'][e]
    if pre + 'fcBias' in P:
        h = h + P[pre + 'fcBias'][e]
    h = F.gelu(h, approximate='tanh' if kind == 'gelu-tanh' else 'none')
    y = h @ P[pre + 'proj'][e]
    if pre + 'projBias' in P:
        y = y + P[pre + 'projBias'][e]
    return y


def moe(P, pre, x, m, kind):
    """x (B, T, C) -> (B, T, C) and the Switch auxiliary loss (0 unless balance = "aux")."""
    B, T, C = x.shape
    N, E, k = B * T, m['experts'], m['topK']
    xf = x.reshape(N, C)
    logits = xf @ P[pre + 'router'].t()
    scores = logits.softmax(-1) if m['router'] == 'softmax' else logits.sigmoid()
    sel = scores.detach().clone()
    if m['balance'] == 'bias':
        sel = sel + P[pre + 'expertBias']
    top = [sorted(range(E), key=lambda e: (-sel[t, e].item(), e))[:k] for t in range(N)]
    counts = [0] * E
    for t in range(N):
        for e in top[t]:
            counts[e] += 1
    cap = math.ceil(m['capacityFactor'] * k * N / E) if m['capacityFactor'] > 0 else N * k
    used = [0] * E
    rows = [torch.zeros(C, dtype=x.dtype) for _ in range(N)]
    for j in range(k):  # first choices claim capacity before second ones
        for t in range(N):
            e = top[t][j]
            if used[e] >= cap:
                continue
            used[e] += 1
            w = scores[t, e] / sum(scores[t, c] for c in top[t]) if m.get('normTopK', False) else scores[t, e]
            rows[t] = rows[t] + w * expert(P, pre + 'experts.', e, xf[t:t + 1], kind)[0]
    out = torch.stack(rows)
    for s in range(m['sharedExperts']):
        out = out + expert(P, pre + 'shared.', s, xf, kind)
    aux = torch.zeros((), dtype=x.dtype)
    if m['balance'] == 'aux':
        norm = scores if m['router'] == 'softmax' else scores / scores.sum(-1, keepdim=True)
        f = torch.tensor([c / (N * k) for c in counts], dtype=x.dtype)
        aux = E * (f * norm.mean(0)).sum()
    return out.view(B, T, C), aux, dropped(counts, cap)


def dropped(counts, cap):
    return sum(max(0, c - cap) for c in counts)


def is_moe(m, i):
    return m['experts'] > 0 and (i + 1) % m['every'] == 0


def gpt(P, idx, c, m):
    B, T = idx.shape
    C, nh, V = c['nEmbd'], c['nHead'], c['vocabSize']
    hs = C // nh
    kind = 'gelu-tanh' if c.get('gelu') == 'tanh' else 'gelu'
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    x = F.embedding(idx, P['wte.weight']) + F.embedding(torch.arange(T), P['wpe.weight'])
    auxes = []
    for i in range(c['nLayer']):
        p = lambda n: P.get(f'layers.{i}.{n}')  # noqa: E731
        h = F.layer_norm(x, (C,), p('ln1.weight'), p('ln1.bias'), 1e-5)
        q, kk, v = F.linear(h, p('attn.qkv.weight'), p('attn.qkv.bias')).split(C, dim=2)
        q, kk, v = (t.view(B, T, nh, hs).transpose(1, 2) for t in (q, kk, v))
        att = ((q @ kk.transpose(-2, -1)) / math.sqrt(hs)).masked_fill(~mask, float('-inf')).softmax(-1)
        x = x + F.linear((att @ v).transpose(1, 2).reshape(B, T, C), p('attn.proj.weight'), p('attn.proj.bias'))
        h = F.layer_norm(x, (C,), p('ln2.weight'), p('ln2.bias'), 1e-5)
        if is_moe(m, i):
            y, aux, _ = moe(P, f'layers.{i}.mlp.', h, m, kind)
            auxes.append(aux)
        else:
            y = F.linear(F.gelu(F.linear(h, p('mlp.fc.weight'), p('mlp.fc.bias'))), p('mlp.proj.weight'), p('mlp.proj.bias'))
        x = x + y
    x = F.layer_norm(x, (C,), P['lnF.weight'], P.get('lnF.bias'), 1e-5)
    return F.linear(x, P['wte.weight'] if c['tieEmbeddings'] else P['head.weight']), auxes


def llama(P, idx, c, m):
    from llama_peer import rotate_half  # the peer's rotary convention (transformers')
    B, T = idx.shape
    C, nh, nkv, hd = c['nEmbd'], c['nHead'], c['nKvHead'], c['headDim']
    eps = c['rmsNormEps']

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    # float32 frequencies (each step rounded as flotilla's ropeInverseFrequencies), float64 angles
    def f32(v):
        return torch.tensor(v, dtype=torch.float32).item()
    inv = torch.tensor([f32(1 / f32(c['ropeTheta'] ** f32(2 * i / hd))) for i in range(hd // 2)], dtype=torch.float64)
    emb = torch.outer(torch.arange(T, dtype=torch.float64), inv)
    emb = torch.cat((emb, emb), -1)
    cos, sin = emb.cos(), emb.sin()
    mask = torch.full((T, T), float('-inf'), dtype=torch.float64).triu(1)
    x = F.embedding(idx, P['wte.weight'])
    auxes = []
    for i in range(c['nLayer']):
        p = lambda n: P[f'layers.{i}.{n}']  # noqa: E731
        h = rms(x, p('attnNorm.weight'))
        q = (h @ p('attn.q.weight').t()).view(B, T, nh, hd).transpose(1, 2)
        kk = (h @ p('attn.k.weight').t()).view(B, T, nkv, hd).transpose(1, 2)
        v = (h @ p('attn.v.weight').t()).view(B, T, nkv, hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        kk = kk * cos + rotate_half(kk) * sin
        g = nh // nkv
        kk, v = kk.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        att = ((q @ kk.transpose(-2, -1)) / math.sqrt(hd) + mask).softmax(-1)
        x = x + (att @ v).transpose(1, 2).reshape(B, T, nh * hd) @ p('attn.o.weight').t()
        h = rms(x, p('mlpNorm.weight'))
        if is_moe(m, i):
            y, aux, _ = moe(P, f'layers.{i}.mlp.', h, m, 'swiglu')
            auxes.append(aux)
        else:
            y = (F.silu(h @ p('mlp.gate.weight').t()) * (h @ p('mlp.up.weight').t())) @ p('mlp.down.weight').t()
        x = x + y
    x = rms(x, P['norm.weight'])
    return x @ (P['wte.weight'] if c['tieEmbeddings'] else P['head.weight']).t(), auxes


def main():
    inputs, _ = load(sys.argv[1])
    c = json.loads(sys.argv[3])
    m = c['moe']
    data = ('x', 'w', 'idx', 'targets')
    P = {k: v.clone().requires_grad_(not k.endswith('expertBias')) for k, v in inputs.items() if k not in data}
    coeff = m['auxCoeff'] if m['balance'] == 'aux' else 0.0
    out = {}
    if c['what'] == 'layer':
        x = inputs['x'].clone().requires_grad_(True)
        y, aux, drop = moe(P, '', x, m, c.get('kind', 'gelu'))
        loss = (y * inputs['w']).sum()
        out['out'] = y.detach()
        out['dropped'] = torch.tensor([float(drop)], dtype=torch.float64)
        auxes = [aux]
    else:
        f = gpt if c['what'] == 'gpt' else llama
        logits, auxes = f(P, inputs['idx'], c, m)
        V = logits.shape[-1]
        loss = F.cross_entropy(logits.reshape(-1, V), inputs['targets'].reshape(-1))
        out['logits'] = logits.detach()
    aux = sum(auxes) if auxes else torch.zeros((), dtype=torch.float64)
    (loss + coeff * aux).backward()
    out['loss'] = loss.detach().reshape(1)
    out['aux'] = torch.as_tensor(aux).detach().reshape(1)
    if c['what'] == 'layer':
        out['grad.x'] = x.grad
    # An expert no token reached has no gradient in PyTorch; flotilla's is zeros.
    out.update({'grad.' + n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in P.items() if p.requires_grad})
    save(sys.argv[2], out)


main()
