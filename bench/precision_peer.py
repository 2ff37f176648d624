"""The PyTorch peer of bench/precision.ts: bench/step.py's GPT training step in float32 or under
torch.autocast('cpu', dtype=torch.bfloat16), the way a PyTorch user writes mixed precision on CPU.

argv: init.safetensors '<json config>'. Prints {"ready", "loss0"}, then answers each stdin line
{"steps": n, "mode": "fp32" | "bf16"} with {"times": [seconds per step]}; an empty line ends it."""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'test', 'oracle'))
from st import load  # noqa: E402
from step import GPT  # noqa: E402

torch.set_num_threads(1)


def main():
    tensors, _ = load(sys.argv[1])
    c = json.loads(sys.argv[2])
    model = GPT(c)
    model.load_state_dict({k: v for k, v in tensors.items() if k not in ('idx', 'targets')}, strict=False)
    idx, targets = tensors['idx'], tensors['targets']
    o = c['adamw']
    opt = torch.optim.AdamW(model.parameters(), lr=o['lr'], betas=tuple(o['betas']), eps=o['eps'], weight_decay=o['weightDecay'])

    def step(mode):
        t0 = time.perf_counter()
        opt.zero_grad()
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=(mode == 'bf16')):
            loss = model(idx, targets)
        loss.backward()
        opt.step()
        loss.item()
        return time.perf_counter() - t0

    with torch.no_grad():
        loss0 = model(idx, targets).item()
    print(json.dumps({'ready': True, 'loss0': loss0, 'torch': torch.__version__}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        req = json.loads(line)
        print(json.dumps({'times': [step(req['mode']) for _ in range(req['steps'])]}), flush=True)


main()
