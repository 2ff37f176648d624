# PyTorch 1.13's torch.optim.AdamW over one flat float32 parameter of N elements, for bench/optim.ts:
# the same hyper-parameters, single-tensor (foreach=False) and multi-tensor (foreach=True) paths;
# prints 'BENCH <json>' with each path's step times (ms) after one warm-up step.
import json, sys, time
import torch

o = json.loads(sys.argv[1])
torch.set_num_threads(o['threads'])
torch.manual_seed(0)
out = {}
for foreach in (False, True):
    p = torch.nn.Parameter(torch.randn(o['N']))
    p.grad = torch.randn(o['N']) * 1e-3
    opt = torch.optim.AdamW([p], lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=foreach)
    ms = []
    for s in range(o['steps'] + 1):
        t0 = time.perf_counter()
        opt.step()
        if s > 0:
            ms.append((time.perf_counter() - t0) * 1e3)
    out['foreach' if foreach else 'single'] = ms
    del opt, p
print('BENCH ' + json.dumps(out))
