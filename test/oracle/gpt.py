"""The flotilla reference GPT written independently in PyTorch, on flotilla's parameter names.

argv: in.safetensors (parameters by flotilla name, 'idx', 'targets') out.safetensors json-config.
Writes 'loss', 'logits' and 'grad.<name>' for every parameter. With config {"adamwSteps": n, ...} it
instead trains n steps with torch.optim.AdamW on batches idx.<s>/targets.<s> and writes the losses and
the final parameters ('param.<name>')."""
import json
import math
import sys

import torch
import torch.nn.functional as F

from st import load, save

torch.set_num_threads(1)


def forward(P, idx, targets, cfg):
    B, T = idx.shape
    C, nh, V = cfg['nEmbd'], cfg['nHead'], cfg['vocabSize']
    hs = C // nh
    head_w = P['wte.weight'] if cfg['tieEmbeddings'] else P['head.weight']
    mask = torch.ones(cfg['blockSize'], cfg['blockSize'], dtype=torch.bool).tril()[:T, :T]
    x = F.embedding(idx, P['wte.weight']) + F.embedding(torch.arange(T), P['wpe.weight'])  # (B, T, C)
    for i in range(cfg['nLayer']):
        p = lambda n: P.get(f'layers.{i}.{n}')  # noqa: E731 (a missing bias is None)
        h = F.layer_norm(x, (C,), p('ln1.weight'), p('ln1.bias'), 1e-5)
        q, k, v = F.linear(h, p('attn.qkv.weight'), p('attn.qkv.bias')).split(C, dim=2)
        q, k, v = (t.view(B, T, nh, hs).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        att = att.masked_fill(~mask, float('-inf')).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + F.linear(y, p('attn.proj.weight'), p('attn.proj.bias'))
        h = F.layer_norm(x, (C,), p('ln2.weight'), p('ln2.bias'), 1e-5)
        x = x + F.linear(F.gelu(F.linear(h, p('mlp.fc.weight'), p('mlp.fc.bias'))), p('mlp.proj.weight'), p('mlp.proj.bias'))
    x = F.layer_norm(x, (C,), P['lnF.weight'], P.get('lnF.bias'), 1e-5)
    logits = F.linear(x, head_w)
    loss = F.cross_entropy(logits.view(B * T, V), targets.reshape(B * T))
    return logits, loss


def main():
    inputs, _ = load(sys.argv[1])
    cfg = json.loads(sys.argv[3])
    P = {k: v.clone().requires_grad_(True) for k, v in inputs.items() if not k.startswith(('idx', 'targets'))}
    if 'adamwSteps' in cfg:
        o = cfg['adamw']
        opt = torch.optim.AdamW(list(P.values()), lr=o['lr'], betas=tuple(o['betas']), eps=o['eps'], weight_decay=o['weightDecay'])
        losses = []
        for s in range(cfg['adamwSteps']):
            opt.zero_grad(set_to_none=False)
            _, loss = forward(P, inputs[f'idx.{s}'], inputs[f'targets.{s}'], cfg)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        out = {'losses': torch.stack(losses)}
        out.update({'param.' + k: v for k, v in P.items()})
        save(sys.argv[2], out)
        return
    logits, loss = forward(P, inputs['idx'], inputs['targets'], cfg)
    loss.backward()
    out = {'loss': loss.detach().reshape(1), 'logits': logits}
    out.update({'grad.' + k: v.grad for k, v in P.items()})
    save(sys.argv[2], out)


main()
