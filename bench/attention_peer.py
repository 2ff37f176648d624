# PyTorch's eager causal attention, forward and backward, for bench/attention.ts: the same sizes and
# steps as bench/attention_run.ts in a fresh process; prints 'BENCH <json>' with the step times,
# VmRSS before the first step and VmHWM after the last.
import json, sys, time, math
import torch

o = json.loads(sys.argv[1])
torch.set_num_threads(o['threads'])
torch.manual_seed(0)
B, H, T, D = o['B'], o['H'], o['T'], o['D']
q, k, v = (torch.randn(B, H, T, D, requires_grad=True) for _ in range(3))
w = torch.randn(B, H, T, D)
mask = torch.ones(T, T, dtype=torch.bool).tril()

def status(field):
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(field + ':'):
                return int(line.split()[1]) * 1024
    return float('nan')

def step():
    att = (q @ k.transpose(-2, -1)) * (1 / math.sqrt(D))
    att = att.masked_fill(~mask, float('-inf')).softmax(-1)
    out = att @ v
    (out * w).sum().backward()
    for t in (q, k, v):
        t.grad = None

base = status('VmRSS')
ms = []
for s in range(o['steps'] + 1):
    t0 = time.perf_counter()
    step()
    if s > 0:
        ms.append((time.perf_counter() - t0) * 1e3)
print('BENCH ' + json.dumps({'stepMs': ms, 'baseBytes': base, 'peakBytes': status('VmHWM')}))
