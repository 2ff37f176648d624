"""The reference GPT (as in gpt.py) under torch.autocast('cpu', dtype=torch.bfloat16), on flotilla's
parameter names, recording the dtype autocast gives each op.

argv: in.safetensors (parameters by flotilla name, 'idx', 'targets') out.safetensors json-config.
Writes 'loss', 'logits' (as float32) and 'grad.<name>' under autocast, the same in plain float32
('fp32.loss', 'fp32.grad.<name>'), and the metadata 'dtypes': {op: dtype} as autocast chose them."""
import json
import math
import sys

import torch
import torch.nn.functional as F

from st import load, save

torch.set_num_threads(1)


def forward(P, idx, targets, cfg, seen):
    def rec(op, t):
        seen.setdefault(op, str(t.dtype).replace('torch.', ''))
        return t

    B, T = idx.shape
    C, nh, V = cfg['nEmbd'], cfg['nHead'], cfg['vocabSize']
    hs = C // nh
    head_w = P['wte.weight'] if cfg['tieEmbeddings'] else P['head.weight']
    mask = torch.ones(cfg['blockSize'], cfg['blockSize'], dtype=torch.bool).tril()[:T, :T]
    x = rec('embedding', F.embedding(idx, P['wte.weight'])) + F.embedding(torch.arange(T), P['wpe.weight'])
    for i in range(cfg['nLayer']):
        p = lambda n: P.get(f'layers.{i}.{n}')  # noqa: E731
        h = rec('layerNorm', F.layer_norm(x, (C,), p('ln1.weight'), p('ln1.bias'), 1e-5))
        q, k, v = rec('linear', F.linear(h, p('attn.qkv.weight'), p('attn.qkv.bias'))).split(C, dim=2)
        q, k, v = (t.view(B, T, nh, hs).transpose(1, 2) for t in (q, k, v))
        att = rec('matmul', q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        att = rec('softmax', att.masked_fill(~mask, float('-inf')).softmax(dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + F.linear(y, p('attn.proj.weight'), p('attn.proj.bias'))
        h = F.layer_norm(x, (C,), p('ln2.weight'), p('ln2.bias'), 1e-5)
        x = x + F.linear(rec('gelu', F.gelu(F.linear(h, p('mlp.fc.weight'), p('mlp.fc.bias')))), p('mlp.proj.weight'), p('mlp.proj.bias'))
    x = F.layer_norm(x, (C,), P['lnF.weight'], P.get('lnF.bias'), 1e-5)
    logits = F.linear(x, head_w)
    loss = rec('loss', F.cross_entropy(logits.view(B * T, V), targets.reshape(B * T)))
    return logits, loss


def run(inputs, cfg, autocast):
    P = {k: v.clone().requires_grad_(True) for k, v in inputs.items() if not k.startswith(('idx', 'targets'))}
    seen = {}
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
        logits, loss = forward(P, inputs['idx'], inputs['targets'], cfg, seen)
    loss.backward()
    return logits, loss, {k: v.grad for k, v in P.items()}, seen


def main():
    inputs, _ = load(sys.argv[1])
    cfg = json.loads(sys.argv[3])
    logits, loss, grads, seen = run(inputs, cfg, True)
    _, loss32, grads32, _ = run(inputs, cfg, False)
    out = {'loss': loss.detach().float().reshape(1), 'logits': logits.detach().float(), 'fp32.loss': loss32.detach().reshape(1)}
    out.update({'grad.' + k: g for k, g in grads.items()})
    out.update({'fp32.grad.' + k: g for k, g in grads32.items()})
    save(sys.argv[2], out, {'dtypes': json.dumps(seen)})


main()
