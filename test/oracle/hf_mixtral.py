"""Reference forward of transformers' MixtralForCausalLM, written from the published model description on
transformers' tensor names and layouts (transformers itself is not installed), and its Hugging Face
directory (config.json, model.safetensors or shards + model.safetensors.index.json).

The Llama's attention (rotary positions in the rotate-half convention, grouped-query heads), RMSNorm, and
in every block a sparse mixture of experts: router logits = h @ gate.weight^T, softmax over the
num_local_experts, the top num_experts_per_tok probabilities renormalised to sum 1, and the token's output
the weighted sum of its chosen experts' w2(silu(w1 h) * w3 h).

argv: in.safetensors ('idx' (B, T) and 'prompt' (1, P) int64) out.safetensors json-args.
args: {"greedy": n, "jobs": [{"mode": "make" | "read", "dir", "config"?, "seed"?, "dtype"?, "maxShardBytes"?}]}
  make: writes a directory of random weights, then reads it back as below.
  read: reads the directory strictly (exactly the tensors the config implies, {"format": "pt"} metadata).
Writes per job i 'logits.<i>' (B, T, V) in float64 and 'greedy.<i>' (n,): argmax decoding after the prompt."""
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

from st import load, save

torch.set_num_threads(1)
DT = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}
INDEX = 'model.safetensors.index.json'


def cfg_of(c):
    d = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=8, head_dim=None, max_position_embeddings=4096 * 32, rms_norm_eps=1e-5,
             rope_theta=1e6, tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2)
    d.update(c)
    if d['head_dim'] is None:
        d['head_dim'] = d['hidden_size'] // d['num_attention_heads']
    return d


def expected(config):
    c = cfg_of(config)
    C, hd, I, E = c['hidden_size'], c['head_dim'], c['intermediate_size'], c['num_local_experts']
    nh, nkv = c['num_attention_heads'], c['num_key_value_heads']
    out = {'model.embed_tokens.weight': [c['vocab_size'], C]}
    for i in range(c['num_hidden_layers']):
        h = f'model.layers.{i}.'
        out.update({h + 'input_layernorm.weight': [C], h + 'post_attention_layernorm.weight': [C],
                    h + 'self_attn.q_proj.weight': [nh * hd, C], h + 'self_attn.k_proj.weight': [nkv * hd, C],
                    h + 'self_attn.v_proj.weight': [nkv * hd, C], h + 'self_attn.o_proj.weight': [C, nh * hd],
                    h + 'block_sparse_moe.gate.weight': [E, C]})
        for j in range(E):
            e = f'{h}block_sparse_moe.experts.{j}.'
            out.update({e + 'w1.weight': [I, C], e + 'w2.weight': [C, I], e + 'w3.weight': [I, C]})
    out['model.norm.weight'] = [C]
    if not c['tie_word_embeddings']:
        out['lm_head.weight'] = [c['vocab_size'], C]
    return out


def inv_freq(c):
    hd = c['head_dim']
    # transformers computes the inverse frequencies in float32.
    exponent = torch.arange(0, hd, 2, dtype=torch.int64).float() / hd
    power = (c['rope_theta'] ** exponent.double()).float()
    return (1.0 / power.double()).float().double()


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def half_turn(x):
    a, b = x[..., :x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-b, a), dim=-1)


def sparse_moe(P, h, c, pre):
    B, T, C = h.shape
    x = h.reshape(-1, C)
    probs = (x @ P[pre + 'gate.weight'].t()).softmax(-1)
    w, chosen = probs.topk(c['num_experts_per_tok'], dim=-1)
    w = w / w.sum(-1, keepdim=True)
    y = torch.zeros_like(x)
    for n in range(x.shape[0]):  # token by token: the plain reading of the description
        for k in range(chosen.shape[1]):
            e = f'{pre}experts.{int(chosen[n, k])}.'
            t = x[n]
            out = (F.silu(P[e + 'w1.weight'] @ t) * (P[e + 'w3.weight'] @ t)) @ P[e + 'w2.weight'].t()
            y[n] += w[n, k] * out
    return y.view(B, T, C)


def forward(P, config, idx):
    c = cfg_of(config)
    B, T = idx.shape
    nh, nkv, hd, eps = c['num_attention_heads'], c['num_key_value_heads'], c['head_dim'], c['rms_norm_eps']
    f = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq(c)[None, :]
    emb = torch.cat((f, f), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    x = P['model.embed_tokens.weight'][idx]
    for i in range(c['num_hidden_layers']):
        p = f'model.layers.{i}.'
        h = rms(x, P[p + 'input_layernorm.weight'], eps)
        q = (h @ P[p + 'self_attn.q_proj.weight'].t()).view(B, T, nh, hd).transpose(1, 2)
        k = (h @ P[p + 'self_attn.k_proj.weight'].t()).view(B, T, nkv, hd).transpose(1, 2)
        v = (h @ P[p + 'self_attn.v_proj.weight'].t()).view(B, T, nkv, hd).transpose(1, 2)
        q, k = q * cos + half_turn(q) * sin, k * cos + half_turn(k) * sin
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        att = ((q @ k.transpose(-1, -2)) / math.sqrt(hd)).masked_fill(~mask, float('-inf')).softmax(-1)
        x = x + (att @ v).transpose(1, 2).reshape(B, T, nh * hd) @ P[p + 'self_attn.o_proj.weight'].t()
        x = x + sparse_moe(P, rms(x, P[p + 'post_attention_layernorm.weight'], eps), c, p + 'block_sparse_moe.')
    x = rms(x, P['model.norm.weight'], eps)
    head = P['model.embed_tokens.weight'] if c['tie_word_embeddings'] else P['lm_head.weight']
    return x @ head.t()


def random_weights(config, seed):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected(config).items():
        n = torch.randn(shape, generator=g, dtype=torch.float64)
        if name.endswith('norm.weight'):
            out[name] = 1 + 0.3 * n
        elif 'embed' in name or 'lm_head' in name or name.endswith('gate.weight'):
            out[name] = n  # a router far from uniform: its choices and weights matter
        else:
            out[name] = n * (1.5 / math.sqrt(shape[1]))
    return out


def write_dir(d, config, P, dtype, max_bytes):
    os.makedirs(d)
    with open(os.path.join(d, 'config.json'), 'w') as f:
        json.dump(config, f, indent=2)
    stored = {k: v.to(DT[dtype]) for k, v in P.items()}
    names = sorted(stored)
    if max_bytes is None:
        save(os.path.join(d, 'model.safetensors'), {k: stored[k] for k in names}, {'format': 'pt'})
        return
    shards, size = [[]], 0
    for k in names:
        b = stored[k].numel() * stored[k].element_size()
        if size + b > max_bytes and shards[-1]:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += b
    wm = {}
    for i, s in enumerate(shards):
        fname = f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors'
        save(os.path.join(d, fname), {k: stored[k] for k in s}, {'format': 'pt'})
        wm.update({k: fname for k in s})
    total = sum(t.numel() * t.element_size() for t in stored.values())
    with open(os.path.join(d, INDEX), 'w') as f:
        json.dump({'metadata': {'total_size': total}, 'weight_map': wm}, f, indent=2)


def read_dir(d):
    with open(os.path.join(d, 'config.json')) as f:
        config = json.load(f)
    assert config['model_type'] == 'mixtral' and config.get('architectures', ['MixtralForCausalLM'])[0] == 'MixtralForCausalLM', config
    assert config.get('sliding_window') is None, 'sliding_window must be null here'
    files = ['model.safetensors']
    wm = None
    if os.path.exists(os.path.join(d, INDEX)):
        with open(os.path.join(d, INDEX)) as f:
            wm = json.load(f)['weight_map']
        files = sorted(set(wm.values()))
    P = {}
    for fname in files:
        t, meta = load(os.path.join(d, fname))
        assert meta.get('format') == 'pt', f'{fname}: metadata {meta}'
        if wm is not None:
            assert all(wm[k] == fname for k in t), f'{fname}: the index places its tensors elsewhere'
        P.update(t)
    want = expected(config)
    have = {k: list(v.shape) for k, v in P.items()}
    assert set(want) == set(have), f'missing {sorted(set(want) - set(have))}, unexpected {sorted(set(have) - set(want))}'
    bad = [f'{k}: {have[k]} vs {want[k]}' for k in want if have[k] != want[k]]
    assert not bad, f'shapes differ from what the config implies: {bad}'
    if wm is not None:
        assert set(wm) == set(want), 'the index does not name exactly the stored tensors'
    return config, {k: v.to(torch.float64) for k, v in P.items()}


def greedy(P, config, prompt, n):
    ids = prompt.clone()
    out = []
    for _ in range(n):
        nxt = int(forward(P, config, ids)[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return torch.tensor(out, dtype=torch.int64)


def main():
    inputs, _ = load(sys.argv[1])
    a = json.loads(sys.argv[3])
    out = {}
    with torch.no_grad():
        for i, job in enumerate(a['jobs']):
            if job['mode'] == 'make':
                write_dir(job['dir'], job['config'], random_weights(job['config'], job['seed']), job['dtype'], job.get('maxShardBytes'))
            config, P = read_dir(job['dir'])
            out[f'logits.{i}'] = forward(P, config, inputs['idx'])
            out[f'greedy.{i}'] = greedy(P, config, inputs['prompt'], a['greedy'])
    save(sys.argv[2], out)


main()
