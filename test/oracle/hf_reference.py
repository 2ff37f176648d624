"""Reference forwards of transformers' GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM and
MistralForCausalLM (the Llama with a sliding attention window: query i reads key j when i - j < sliding_window; Qwen's
windows from layer max_window_layers on with use_sliding_window: hf_windows.py), written from the published
model descriptions on transformers' tensor names and layouts (transformers itself is not installed), and
the Hugging Face directory layout (config.json, model.safetensors or shards + model.safetensors.index.json).

argv: in.safetensors ('idx' (B, T) and 'prompt' (1, P) int64) out.safetensors json-args.
args: {"greedy": n, "jobs": [{"mode": "make" | "read", "dir": ..., ...}, ...]} (one process for many
directories: starting PyTorch is the slow part).
  make: {"config": config.json, "seed", "dtype": "float32" | "bfloat16" | "float16", "maxShardBytes"?, "legacy"?}
        writes a directory of random weights (legacy: GPT-2 names without "transformer." and the
        attn.bias / attn.masked_bias buffers, as the original gpt2 upload), then reads it back as below.
  read: reads the directory strictly: exactly the tensors transformers' model class has for config.json
        (names, shapes, the index naming every file), each file's {"format": "pt"} metadata.
Writes per job i 'logits.<i>' (B, T, V) in float64 from the stored weights and 'greedy.<i>' (n,):
argmax decoding of n tokens after the prompt (float64, the whole context recomputed each step)."""
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


# ---- the tensors each model class has, from its config (transformers' defaults where a field is absent)

def gpt2_cfg(c):
    d = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
             activation_function='gelu_new', layer_norm_epsilon=1e-5, tie_word_embeddings=True)
    d.update(c)
    return d


def llama_cfg(c):
    d = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=None, head_dim=None, max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
             rope_scaling=None, tie_word_embeddings=False, hidden_act='silu', attention_bias=False, mlp_bias=False)
    if c['model_type'] in ('qwen2', 'qwen3'):
        # Qwen2Config / Qwen3Config defaults; Qwen2 has q, k, v biases always, Qwen3 q_norm and k_norm.
        d.update(vocab_size=151936, intermediate_size=22016, max_position_embeddings=32768)
        if c['model_type'] == 'qwen3':
            d['head_dim'] = 128
    d.update(c)
    if d['num_key_value_heads'] is None:
        d['num_key_value_heads'] = d['num_attention_heads']
    if d['head_dim'] is None:
        d['head_dim'] = d['hidden_size'] // d['num_attention_heads']
    return d


def mistral_cfg(c):
    # MistralConfig's defaults (Mistral 7B), then the Llama's fields it shares; sliding_window None = full causal.
    d = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=8, head_dim=None, max_position_embeddings=4096 * 32, rms_norm_eps=1e-6, rope_theta=10000.0,
             sliding_window=4096, tie_word_embeddings=False, hidden_act='silu')
    d.update(c)
    return llama_cfg(d)


def expected(config):
    """{name: shape} of the state dict transformers saves for this config (a tied head not stored)."""
    out = {}
    if config['model_type'] == 'gpt2':
        c = gpt2_cfg(config)
        C, inner = c['n_embd'], c['n_inner'] or 4 * c['n_embd']
        out['transformer.wte.weight'] = [c['vocab_size'], C]
        out['transformer.wpe.weight'] = [c['n_positions'], C]
        for i in range(c['n_layer']):
            h = f'transformer.h.{i}.'
            out.update({h + 'ln_1.weight': [C], h + 'ln_1.bias': [C],
                        h + 'attn.c_attn.weight': [C, 3 * C], h + 'attn.c_attn.bias': [3 * C],
                        h + 'attn.c_proj.weight': [C, C], h + 'attn.c_proj.bias': [C],
                        h + 'ln_2.weight': [C], h + 'ln_2.bias': [C],
                        h + 'mlp.c_fc.weight': [C, inner], h + 'mlp.c_fc.bias': [inner],
                        h + 'mlp.c_proj.weight': [inner, C], h + 'mlp.c_proj.bias': [C]})
        out['transformer.ln_f.weight'] = [C]
        out['transformer.ln_f.bias'] = [C]
        if not c['tie_word_embeddings']:
            out['lm_head.weight'] = [c['vocab_size'], C]
    elif config['model_type'] in ('llama', 'qwen2', 'qwen3', 'mistral'):
        c = mistral_cfg(config) if config['model_type'] == 'mistral' else llama_cfg(config)
        qkv_bias = config['model_type'] == 'qwen2' or (config['model_type'] == 'qwen3' and c['attention_bias'])
        o_bias = config['model_type'] == 'qwen3' and c['attention_bias']
        C, hd, I = c['hidden_size'], c['head_dim'], c['intermediate_size']
        nh, nkv = c['num_attention_heads'], c['num_key_value_heads']
        out['model.embed_tokens.weight'] = [c['vocab_size'], C]
        for i in range(c['num_hidden_layers']):
            h = f'model.layers.{i}.'
            out.update({h + 'input_layernorm.weight': [C],
                        h + 'self_attn.q_proj.weight': [nh * hd, C], h + 'self_attn.k_proj.weight': [nkv * hd, C],
                        h + 'self_attn.v_proj.weight': [nkv * hd, C], h + 'self_attn.o_proj.weight': [C, nh * hd],
                        h + 'post_attention_layernorm.weight': [C],
                        h + 'mlp.gate_proj.weight': [I, C], h + 'mlp.up_proj.weight': [I, C], h + 'mlp.down_proj.weight': [C, I]})
            if qkv_bias:
                out.update({h + 'self_attn.q_proj.bias': [nh * hd], h + 'self_attn.k_proj.bias': [nkv * hd], h + 'self_attn.v_proj.bias': [nkv * hd]})
            if o_bias:
                out[h + 'self_attn.o_proj.bias'] = [C]
            if config['model_type'] == 'qwen3':
                out.update({h + 'self_attn.q_norm.weight': [hd], h + 'self_attn.k_norm.weight': [hd]})
        out['model.norm.weight'] = [C]
        if not c['tie_word_embeddings']:
            out['lm_head.weight'] = [c['vocab_size'], C]
    else:
        raise SystemExit(f'unknown model_type {config["model_type"]}')
    return out


# ---- forwards (float64), on transformers' names

def gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gpt2_forward(P, c, idx):
    c = gpt2_cfg(c)
    B, T = idx.shape
    C, nh = c['n_embd'], c['n_head']
    hs = C // nh
    act = F.gelu if c['activation_function'] == 'gelu' else gelu_new
    eps = c['layer_norm_epsilon']
    x = P['transformer.wte.weight'][idx] + P['transformer.wpe.weight'][torch.arange(T)]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(c['n_layer']):
        p = lambda n: P[f'transformer.h.{i}.{n}']  # noqa: E731
        h = F.layer_norm(x, (C,), p('ln_1.weight'), p('ln_1.bias'), eps)
        qkv = h @ p('attn.c_attn.weight') + p('attn.c_attn.bias')  # Conv1D: x W + b, W [in, out]
        q, k, v = (t.view(B, T, nh, hs).transpose(1, 2) for t in qkv.split(C, dim=2))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(hs)
        att = att.masked_fill(~causal, float('-inf')).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + (y @ p('attn.c_proj.weight') + p('attn.c_proj.bias'))
        h = F.layer_norm(x, (C,), p('ln_2.weight'), p('ln_2.bias'), eps)
        x = x + (act(h @ p('mlp.c_fc.weight') + p('mlp.c_fc.bias')) @ p('mlp.c_proj.weight') + p('mlp.c_proj.bias'))
    x = F.layer_norm(x, (C,), P['transformer.ln_f.weight'], P['transformer.ln_f.bias'], eps)
    head = P['transformer.wte.weight'] if c['tie_word_embeddings'] else P['lm_head.weight']
    return x @ head.t()


def rope_inv_freq(c):
    hd = c['head_dim']
    # transformers computes the inverse frequencies in float32: each step here is rounded to float32 once.
    exponent = torch.arange(0, hd, 2, dtype=torch.int64).float() / hd
    power = (c['rope_theta'] ** exponent.double()).float()
    inv = (1.0 / power.double()).float().double()
    rs = c['rope_scaling']
    if rs is None:
        return inv
    kind = rs.get('rope_type', rs.get('type'))
    if kind == 'default':
        return inv
    assert kind == 'llama3', kind
    # Llama 3.1: wavelengths above low_freq_wavelen divided by factor, below high_freq_wavelen kept,
    # in between a smooth interpolation of the two.
    factor, lo, hi, old = rs['factor'], rs['low_freq_factor'], rs['high_freq_factor'], rs['original_max_position_embeddings']
    low_wl, high_wl = old / lo, old / hi
    out = []
    for f in inv.tolist():
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(f)
        elif wl > low_wl:
            out.append(f / factor)
        else:
            s = (old / wl - lo) / (hi - lo)
            out.append((1 - s) * f / factor + s * f)
    return torch.tensor(out, dtype=torch.float64)


def rotate_half(x):
    x1, x2 = x[..., :x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rms_norm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def linear(h, P, name):
    """nn.Linear on transformers' names: h W^T (+ b when the state dict has the bias)."""
    y = h @ P[name + '.weight'].t()
    return y + P[name + '.bias'] if name + '.bias' in P else y


def llama_forward(P, c, idx):
    qwen3 = c['model_type'] == 'qwen3'
    c = mistral_cfg(c) if c['model_type'] == 'mistral' else llama_cfg(c)
    B, T = idx.shape
    nh, nkv, hd, eps = c['num_attention_heads'], c['num_key_value_heads'], c['head_dim'], c['rms_norm_eps']
    freqs = torch.arange(T, dtype=torch.float64)[:, None] * rope_inv_freq(c)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()  # (T, hd)
    x = P['model.embed_tokens.weight'][idx]
    for i in range(c['num_hidden_layers']):
        p = lambda n: P[f'model.layers.{i}.{n}']  # noqa: E731
        h = rms_norm(x, p('input_layernorm.weight'), eps)
        a = f'model.layers.{i}.self_attn.'
        q = linear(h, P, a + 'q_proj').view(B, T, nh, hd)
        k = linear(h, P, a + 'k_proj').view(B, T, nkv, hd)
        v = linear(h, P, a + 'v_proj').view(B, T, nkv, hd).transpose(1, 2)
        if qwen3:  # RMSNorm over each head's width, before the rotary positions
            q = rms_norm(q, p('self_attn.q_norm.weight'), eps)
            k = rms_norm(k, p('self_attn.k_norm.weight'), eps)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # Grouped-query attention: query head j reads key/value head j // (nh / nkv).
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        # Each layer's own mask: causal, within its sliding window if it has one (hf_windows.py).
        att = att.masked_fill(~layer_mask(c, i, T), float('-inf')).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, nh * hd)
        x = x + linear(y, P, a + 'o_proj')
        h = rms_norm(x, p('post_attention_layernorm.weight'), eps)
        x = x + (F.silu(h @ p('mlp.gate_proj.weight').t()) * (h @ p('mlp.up_proj.weight').t())) @ p('mlp.down_proj.weight').t()
    x = rms_norm(x, P['model.norm.weight'], eps)
    head = P['model.embed_tokens.weight'] if c['tie_word_embeddings'] else P['lm_head.weight']
    return x @ head.t()


def forward(P, config, idx):
    return gpt2_forward(P, config, idx) if config['model_type'] == 'gpt2' else llama_forward(P, config, idx)


# ---- directories

def random_weights(config, seed):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected(config).items():
        n = torch.randn(shape, generator=g, dtype=torch.float64)
        if name.endswith('norm.weight') or '.ln_' in name:
            t = 1 + 0.3 * n if name.endswith('weight') else 0.3 * n
        elif name.endswith('.bias'):
            t = 0.3 * n
        elif 'wpe' in name or 'embed' in name or 'wte' in name or 'lm_head' in name:
            t = n
        else:  # weights far from their usual init, so every nonlinearity is exercised
            fan_in = shape[0] if config['model_type'] == 'gpt2' else shape[1]
            t = n * (1.5 / math.sqrt(fan_in))
        out[name] = t
    return out


def write_dir(d, config, P, dtype, max_bytes, legacy):
    os.makedirs(d)
    with open(os.path.join(d, 'config.json'), 'w') as f:
        json.dump(config, f, indent=2)
    stored = {k: v.to(DT[dtype]) for k, v in P.items()}
    if legacy:  # the original gpt2 upload: GPT2Model's names, with the causal-mask buffers
        c = gpt2_cfg(config)
        renamed = {}
        for k, v in stored.items():
            renamed[k[len('transformer.'):] if k.startswith('transformer.') else k] = v
            if k.endswith('attn.c_attn.bias'):
                stem = k[len('transformer.'):-len('c_attn.bias')]
                n = c['n_positions']
                renamed[stem + 'bias'] = torch.ones(n, n).tril().view(1, 1, n, n).to(DT[dtype])
                renamed[stem + 'masked_bias'] = torch.tensor(-1e4).to(DT[dtype])
        stored = renamed
    names = sorted(stored)
    if max_bytes is None:
        save(os.path.join(d, 'model.safetensors'), {k: stored[k] for k in names}, {'format': 'pt'})
    else:
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


def read_dir(d, strict):
    with open(os.path.join(d, 'config.json')) as f:
        config = json.load(f)
    files = ['model.safetensors']
    if os.path.exists(os.path.join(d, INDEX)):
        with open(os.path.join(d, INDEX)) as f:
            wm = json.load(f)['weight_map']
        files = sorted(set(wm.values()))
    P = {}
    for fname in files:
        t, meta = load(os.path.join(d, fname))
        if strict:
            assert meta.get('format') == 'pt', f'{fname}: metadata {meta}, transformers wants {{"format": "pt"}}'
            if len(files) > 1:
                assert all(wm[k] == fname for k in t), f'{fname}: the index places its tensors elsewhere'
        P.update(t)
    if strict:
        want = expected(config)
        have = {k: list(v.shape) for k, v in P.items()}
        missing = sorted(set(want) - set(have))
        unexpected = sorted(set(have) - set(want))
        assert not missing and not unexpected, f'missing {missing}, unexpected {unexpected}'
        bad = [f'{k}: {have[k]} vs {want[k]}' for k in want if have[k] != want[k]]
        assert not bad, f'shapes differ from what the config implies: {bad}'
        if len(files) > 1:
            assert set(wm) == set(want), 'the index does not name exactly the stored tensors'
    else:
        P = {('transformer.' + k if config['model_type'] == 'gpt2' and not k.startswith(('transformer.', 'lm_head.')) else k): v
             for k, v in P.items() if not k.endswith(('.attn.bias', '.attn.masked_bias'))}
    return config, {k: v.to(torch.float64) for k, v in P.items()}


def greedy(P, config, prompt, n):
    ids = prompt.clone()
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(forward(P, config, ids)[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return torch.tensor(out, dtype=torch.int64)


def main():
    inputs, _ = load(sys.argv[1])
    a = json.loads(sys.argv[3])
    out = {}
    for i, job in enumerate(a['jobs']):
        if job['mode'] == 'make':
            P = random_weights(job['config'], job['seed'])
            write_dir(job['dir'], job['config'], P, job['dtype'], job.get('maxShardBytes'), job.get('legacy', False))
        config, P = read_dir(job['dir'], strict=job['mode'] == 'read')
        with torch.no_grad():
            out[f'logits.{i}'] = forward(P, config, inputs['idx'])
        out[f'greedy.{i}'] = greedy(P, config, inputs['prompt'], a['greedy'])
    save(sys.argv[2], out)


main()
