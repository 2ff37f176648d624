"""A reader of PEFT LoRA adapter directories of its own: adapter_config.json (json) and
adapter_model.safetensors (st.py's header parse), merged into a Hugging Face base as PEFT defines
the merge: W + scale * B @ A, scale = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora), the
delta transposed when fan_in_fan_out (a base stored [in, out], GPT-2's Conv1D). In float64.

argv: in.safetensors (unused) out.safetensors json {"adapter": dir, "base": dir}.
An MoE model's experts are Linears to PEFT, each its own module ('...experts.<j>.w1',
'...experts.<j>.gate_proj'), merged into its own stored weight like any other.
Writes 'A.<module>' and 'B.<module>' (the stored matrices, as read), 'merged.<hf weight name>' for
every adapted module (float64); metadata 'config' (adapter_config.json as read), 'names' (every
stored tensor name -> shape) and 'experts' (each expert projection '<...experts>.<name>' -> the
expert indices adapted, in order)."""
import json
import math
import os
import re
import sys

import torch

from st import load, save

args = json.loads(sys.argv[3])
adapter, base = args['adapter'], args['base']
with open(os.path.join(adapter, 'adapter_config.json'), encoding='utf-8') as f:
    config = json.load(f)
stored, _ = load(os.path.join(adapter, 'adapter_model.safetensors'))
weights, _ = load(os.path.join(base, 'model.safetensors'))

r = config['r']
scale = config['lora_alpha'] / (math.sqrt(r) if config['use_rslora'] else r)
pattern = re.compile(r'^base_model\.model\.(.+)\.lora_([AB])\.weight$')
out = {}
modules = set()
for name, t in stored.items():
    m = pattern.match(name)
    if not m:
        raise SystemExit(f'unexpected tensor name {name}')
    modules.add(m.group(1))
    out[f'{m.group(2)}.{m.group(1)}'] = t.clone()
for module in sorted(modules):
    A = stored[f'base_model.model.{module}.lora_A.weight'].double()
    B = stored[f'base_model.model.{module}.lora_B.weight'].double()
    W = weights[f'{module}.weight'].double()
    if A.dim() != 2 or B.dim() != 2 or A.shape[0] != r or B.shape[1] != r:
        raise SystemExit(f'{module}: lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)} are not (r, in) and (out, r) for r = {r}')
    delta = scale * (B @ A)
    if config['fan_in_fan_out']:
        delta = delta.t()
    if delta.shape != W.shape:
        raise SystemExit(f'{module}: delta {tuple(delta.shape)} does not fit the base weight {tuple(W.shape)}')
    out[f'merged.{module}.weight'] = W + delta
names = {name: list(t.shape) for name, t in stored.items()}
expert = re.compile(r'^(.+\.experts)\.(\d+)\.([^.]+)$')
experts = {}
for module in modules:
    m = expert.match(module)
    if m:
        experts.setdefault(f'{m.group(1)}.{m.group(3)}', []).append(int(m.group(2)))
experts = {k: sorted(v) for k, v in experts.items()}
save(sys.argv[2], out, {'config': json.dumps(config), 'names': json.dumps(names), 'experts': json.dumps(experts)})
