# PyTorch 1.13 eager peer of bench/linear_ce.ts: linear + cross_entropy(sum, ignore_index -100) +
# backward on the same shapes and targets; prints one JSON line (median ms, peak RSS, RSS above inputs).
import json, sys, time, resource
import torch

def rss_kib(field):
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(field + ':'):
                return int(line.split()[1])

tokens, dim, vocab, iters, threads = (int(a) for a in sys.argv[1:6])
torch.set_num_threads(threads)
torch.manual_seed(0)
h = torch.randn(tokens, dim, requires_grad=True)
w = (torch.randn(vocab, dim) * 0.02).requires_grad_()
t = torch.tensor([-100 if i % 10 == 9 else (i * 7919) % vocab for i in range(tokens)], dtype=torch.int64)
base = rss_kib('VmRSS')
times = []
loss = 0.0
for i in range(iters + 1):
    t0 = time.perf_counter()
    l = torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w), t, reduction='sum')
    l.backward()
    loss = l.item()
    del l
    if i > 0:
        times.append((time.perf_counter() - t0) * 1000)
    h.grad.zero_()
    w.grad.zero_()
times.sort()
peak = rss_kib('VmHWM')
print(json.dumps({'kind': 'torch 1.13 eager', 'ms': times[len(times) // 2], 'peakMiB': peak / 1024, 'extraMiB': (peak - base) / 1024, 'loss': loss}))
