"""DPO oracle: a GPT written functionally here, in float64, each sequence run alone, and the DPO and IPO
losses computed from its own log-probabilities (the DPO paper's -log sigmoid(beta h); IPO's
(h - 1/(2 beta))^2 on per-token means, as TRL).

argv: in.safetensors out.safetensors json-config. Inputs: the policy's parameters by flotilla name (with
'<path>.loraA.weight' / '<path>.loraB.weight' for an adapted Linear: y = W x + b + scale B(A(x))); with
config "reference": "copy" the reference's parameters as 'ref.<name>', with "adapters" the reference is
the policy with its adapters off; 'seq.<s>.x' and 'seq.<s>.y' (int64 (T,), -100 where no target is
trained). Config: the model config, "beta", "loss" ("sigmoid"|"ipo"), "pairs" [[chosen, rejected], ...],
"scale" (LoRA). Writes 'loss' (mean over pairs), 'rewardsChosen', 'rewardsRejected', 'rewardsMargin',
'rewardsAccuracy' (means over pairs), 'policy' and 'reference' (per-sequence log-probability sums) and
'grad.<name>' for every trained parameter (the adapters with LoRA, else every parameter)."""
import json
import math
import sys

import torch
import torch.nn.functional as F

from st import load, save

torch.set_num_threads(1)


def gpt(P, adapters, idx, c):
    """Logits (T, V) of one sequence idx (T,); adapters: path -> (A, B, scale), or {} for none."""
    T = idx.shape[0]
    C, nh = c['nEmbd'], c['nHead']
    hs = C // nh

    def lin(path, x):
        y = F.linear(x, P[path + '.weight'], P.get(path + '.bias'))
        if path in adapters:
            A, B, s = adapters[path]
            y = y + s * ((x @ A.t()) @ B.t())
        return y
    act = (lambda t: F.gelu(t, approximate='tanh')) if c.get('gelu') == 'tanh' else F.gelu
    mask = torch.full((T, T), float('-inf'), dtype=torch.float64).triu(1)
    x = P['wte.weight'][idx] + P['wpe.weight'][torch.arange(T)]
    for i in range(c['nLayer']):
        f = f'layers.{i}.'
        h = F.layer_norm(x, (C,), P[f + 'ln1.weight'], P.get(f + 'ln1.bias'), 1e-5)
        q, k, v = (t.view(T, nh, hs).transpose(0, 1) for t in lin(f + 'attn.qkv', h).split(C, dim=1))
        att = ((q @ k.transpose(-2, -1)) / math.sqrt(hs) + mask).softmax(-1)
        x = x + lin(f + 'attn.proj', (att @ v).transpose(0, 1).reshape(T, C))
        h = F.layer_norm(x, (C,), P[f + 'ln2.weight'], P.get(f + 'ln2.bias'), 1e-5)
        x = x + lin(f + 'mlp.proj', act(lin(f + 'mlp.fc', h)))
    x = F.layer_norm(x, (C,), P['lnF.weight'], P.get('lnF.bias'), 1e-5)
    return F.linear(x, P['wte.weight']) if c.get('tieEmbeddings', False) else lin('head', x)


def logp(P, adapters, x, y, c):
    """The summed log-probability of the trained targets of one sequence, and how many there are."""
    lp = gpt(P, adapters, x, c).log_softmax(-1)
    keep = y != -100
    picked = lp[torch.arange(x.shape[0])[keep], y[keep]]
    return picked.sum(), int(keep.sum())


def main():
    inputs, _ = load(sys.argv[1])
    c = json.loads(sys.argv[3])
    n = len([k for k in inputs if k.startswith('seq.') and k.endswith('.x')])
    seqs = [(inputs[f'seq.{s}.x'], inputs[f'seq.{s}.y']) for s in range(n)]
    P = {k: v.to(torch.float64) for k, v in inputs.items() if not k.startswith(('seq.', 'ref.'))}
    lora = sorted(k[: -len('.loraA.weight')] for k in P if k.endswith('.loraA.weight'))
    trained = {}
    if lora:
        for path in lora:
            for ab in ('loraA', 'loraB'):
                trained[f'{path}.{ab}.weight'] = P[f'{path}.{ab}.weight'].clone().requires_grad_(True)
        base = {k: v for k, v in P.items() if '.lora' not in k}
        policy_params = base
        adapters = {p: (trained[f'{p}.loraA.weight'], trained[f'{p}.loraB.weight'], c['scale']) for p in lora}
    else:
        trained = {k: v.clone().requires_grad_(True) for k, v in P.items()}
        policy_params, adapters = trained, {}
    if c['reference'] == 'copy':
        ref_params, ref_adapters = {k[4:]: v.to(torch.float64) for k, v in inputs.items() if k.startswith('ref.')}, {}
    else:
        assert lora, 'reference "adapters" needs an adapted policy'
        ref_params, ref_adapters = {k: v for k, v in P.items() if '.lora' not in k}, {}
    pol, lens = zip(*(logp(policy_params, adapters, x, y, c) for x, y in seqs))
    with torch.no_grad():
        ref = [logp(ref_params, ref_adapters, x, y, c)[0] for x, y in seqs]
    beta = c['beta']
    losses, rc, rr = [], [], []
    for ci, ri in c['pairs']:
        pc, pr, qc, qr = pol[ci], pol[ri], ref[ci], ref[ri]
        if c['loss'] == 'ipo':
            pc, qc = pc / lens[ci], qc / lens[ci]
            pr, qr = pr / lens[ri], qr / lens[ri]
        h = (pc - qc) - (pr - qr)
        losses.append(-F.logsigmoid(beta * h) if c['loss'] == 'sigmoid' else (h - 1 / (2 * beta)) ** 2)
        rc.append(beta * (pc - qc).detach())
        rr.append(beta * (pr - qr).detach())
    loss = torch.stack(losses).mean()
    loss.backward()
    rc, rr = torch.stack(rc), torch.stack(rr)
    out = {
        'loss': loss.detach().reshape(1),
        'rewardsChosen': rc.mean().reshape(1), 'rewardsRejected': rr.mean().reshape(1),
        'rewardsMargin': (rc - rr).mean().reshape(1), 'rewardsAccuracy': (rc > rr).to(torch.float64).mean().reshape(1),
        'policy': torch.stack([p.detach() for p in pol]), 'reference': torch.stack(ref),
    }
    for k, v in trained.items():
        out['grad.' + k] = v.grad if v.grad is not None else torch.zeros_like(v)
    save(sys.argv[2], out)


main()
