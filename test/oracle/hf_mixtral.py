"""Reference forward of transformers' MixtralForCausalLM and Qwen3MoeForCausalLM, written from the published model description on
transformers' tensor names and layouts (transformers itself is not installed), and its Hugging Face
directory (config.json, model.safetensors or shards + model.safetensors.index.json).

The Llama's attention (rotary positions in the rotate-half convention, grouped-query heads), RMSNorm, and
in every block a sparse mixture of experts (each layer's sliding window as hf_windows.py decides): router logits = h @ gate.weight^T, softmax over the
num_local_experts, the top num_experts_per_tok probabilities renormalised to sum 1, and the token's output
the weighted sum of its chosen experts' w2(silu(w1 h) * w3 h).

Qwen3-MoE (model_type "qwen3_moe"): the same with Qwen3's attention (each query and key head RMSNormed by
q_norm / k_norm, weights of head_dim, before the rotary positions; biases on q, k, v, o with attention_bias),
head_dim hidden_size / num_attention_heads unless given; layer i sparse iff i is not in mlp_only_layers and
(i + 1) % decoder_sparse_step == 0, else a dense SwiGLU MLP of intermediate_size (mlp.{gate,up,down}_proj);
the router mlp.gate over num_experts, renormalised only with norm_topk_prob; experts
mlp.experts.j.{gate,up,down}_proj of moe_intermediate_size.

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
from hf_windows import layer_mask

torch.set_num_threads(1)
DT = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}
INDEX = 'model.safetensors.index.json'


def cfg_of(c):
    if c.get('model_type') == 'qwen3_moe':
        d = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=None, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=10000.0,
                 tie_word_embeddings=False, attention_bias=False, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
                 moe_intermediate_size=768, norm_topk_prob=False, mlp_only_layers=None)
        d.update(c)
        if d['head_dim'] is None:
            d['head_dim'] = d['hidden_size'] // d['num_attention_heads']
        return d
    d = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=8, head_dim=None, max_position_embeddings=4096 * 32, rms_norm_eps=1e-5,
             rope_theta=1e6, tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2)
    d.update(c)
    if d['head_dim'] is None:
        d['head_dim'] = d['hidden_size'] // d['num_attention_heads']
    return d


def qwen3_moe(c):
    return c.get('model_type') == 'qwen3_moe'


def sparse_layer(c, i):
    if not qwen3_moe(c):
        return True
    return i not in (c['mlp_only_layers'] or []) and (i + 1) % c['decoder_sparse_step'] == 0


def moe_names(c, h):
    """The router, the experts' (gate, up, down) names and the expert width of a sparse layer."""
    if qwen3_moe(c):
        return h + 'mlp.', 'gate.weight', ('gate_proj', 'up_proj', 'down_proj'), c['moe_intermediate_size'], c['num_experts']
    return h + 'block_sparse_moe.', 'gate.weight', ('w1', 'w3', 'w2'), c['intermediate_size'], c['num_local_experts']


def expected(config):
    c = cfg_of(config)
    if qwen3_moe(c):
        return expected_qwen3_moe(c)
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


def expected_qwen3_moe(c):
    C, hd, I = c['hidden_size'], c['head_dim'], c['intermediate_size']
    nh, nkv = c['num_attention_heads'], c['num_key_value_heads']
    out = {'model.embed_tokens.weight': [c['vocab_size'], C]}
    for i in range(c['num_hidden_layers']):
        h = f'model.layers.{i}.'
        out.update({h + 'input_layernorm.weight': [C], h + 'post_attention_layernorm.weight': [C],
                    h + 'self_attn.q_proj.weight': [nh * hd, C], h + 'self_attn.k_proj.weight': [nkv * hd, C],
                    h + 'self_attn.v_proj.weight': [nkv * hd, C], h + 'self_attn.o_proj.weight': [C, nh * hd],
                    h + 'self_attn.q_norm.weight': [hd], h + 'self_attn.k_norm.weight': [hd]})
        if c['attention_bias']:
            out.update({h + 'self_attn.q_proj.bias': [nh * hd], h + 'self_attn.k_proj.bias': [nkv * hd],
                        h + 'self_attn.v_proj.bias': [nkv * hd], h + 'self_attn.o_proj.bias': [C]})
        if sparse_layer(c, i):
            pre, router, (g, u, dn), H, E = moe_names(c, h)
            out[pre + router] = [E, C]
            for j in range(E):
                e = f'{pre}experts.{j}.'
                out.update({f'{e}{g}.weight': [H, C], f'{e}{u}.weight': [H, C], f'{e}{dn}.weight': [C, H]})
        else:
            out.update({h + 'mlp.gate_proj.weight': [I, C], h + 'mlp.up_proj.weight': [I, C], h + 'mlp.down_proj.weight': [C, I]})
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
    _, router, (g, u, dn), _, _ = moe_names(c, '')
    x = h.reshape(-1, C)
    probs = (x @ P[pre + router].t()).softmax(-1)
    w, chosen = probs.topk(c['num_experts_per_tok'], dim=-1)
    if not qwen3_moe(c) or c['norm_topk_prob']:
        w = w / w.sum(-1, keepdim=True)
    y = torch.zeros_like(x)
    for n in range(x.shape[0]):  # token by token: the plain reading of the description
        for k in range(chosen.shape[1]):
            e = f'{pre}experts.{int(chosen[n, k])}.'
            t = x[n]
            out = (F.silu(P[f'{e}{g}.weight'] @ t) * (P[f'{e}{u}.weight'] @ t)) @ P[f'{e}{dn}.weight'].t()
            y[n] += w[n, k] * out
    return y.view(B, T, C)


def proj(P, name, x):
    y = x @ P[name + '.weight'].t()
    return y + P[name + '.bias'] if name + '.bias' in P else y


def forward(P, config, idx):
    c = cfg_of(config)
    B, T = idx.shape
    nh, nkv, hd, eps = c['num_attention_heads'], c['num_key_value_heads'], c['head_dim'], c['rms_norm_eps']
    f = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq(c)[None, :]
    emb = torch.cat((f, f), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    x = P['model.embed_tokens.weight'][idx]
    for i in range(c['num_hidden_layers']):
        p = f'model.layers.{i}.'
        h = rms(x, P[p + 'input_layernorm.weight'], eps)
        a = p + 'self_attn.'
        q = (proj(P, a + 'q_proj', h)).view(B, T, nh, hd)
        k = (proj(P, a + 'k_proj', h)).view(B, T, nkv, hd)
        v = (proj(P, a + 'v_proj', h)).view(B, T, nkv, hd).transpose(1, 2)
        if qwen3_moe(c):
            q, k = rms(q, P[a + 'q_norm.weight'], eps), rms(k, P[a + 'k_norm.weight'], eps)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q, k = q * cos + half_turn(q) * sin, k * cos + half_turn(k) * sin
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        att = ((q @ k.transpose(-1, -2)) / math.sqrt(hd)).masked_fill(~layer_mask(c, i, T), float('-inf')).softmax(-1)
        x = x + proj(P, a + 'o_proj', (att @ v).transpose(1, 2).reshape(B, T, nh * hd))
        h = rms(x, P[p + 'post_attention_layernorm.weight'], eps)
        if sparse_layer(c, i):
            x = x + sparse_moe(P, h, c, moe_names(c, p)[0])
        else:
            m = p + 'mlp.'
            x = x + (F.silu(h @ P[m + 'gate_proj.weight'].t()) * (h @ P[m + 'up_proj.weight'].t())) @ P[m + 'down_proj.weight'].t()
    x = rms(x, P['model.norm.weight'], eps)
    head = P['model.embed_tokens.weight'] if c['tie_word_embeddings'] else P['lm_head.weight']
    return x @ head.t()


def random_weights(config, seed):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected(config).items():
        n = torch.randn(shape, generator=g, dtype=torch.float64)
        if name.endswith('.bias'):
            out[name] = 0.3 * n
        elif name.endswith('norm.weight'):
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
    if qwen3_moe(config):
        assert config.get('architectures', ['Qwen3MoeForCausalLM'])[0] == 'Qwen3MoeForCausalLM', config
    else:
        assert config['model_type'] == 'mixtral' and config.get('architectures', ['MixtralForCausalLM'])[0] == 'MixtralForCausalLM', config
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
