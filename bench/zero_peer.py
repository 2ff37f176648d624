# PyTorch peer of bench/zero_rank.ts: DistributedDataParallel with AdamW, and with
# ZeroRedundancyOptimizer(AdamW) (ZeRO-1), over Gloo, one intra-op thread. FSDP is not measured:
# PyTorch 1.13's torch.distributed.fsdp does not import under Python 3.11 (a dataclass with a
# mutable default in torch.distributed._shard). Prints one JSON line per rank.
import json, os, sys, time
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer

sys.path.insert(0, os.path.dirname(__file__))
from peer_gpt import GPT, V, T  # noqa: E402

opts = json.loads(sys.argv[1])
torch.set_num_threads(1)
dist.init_process_group('gloo')
rank = dist.get_rank()
out = {'rank': rank}
for mode in ('ddp', 'zero1'):
    torch.manual_seed(0)
    model = GPT()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=opts['bucketMb'])
    if mode == 'ddp':
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
    torch.manual_seed(1 + rank)
    x = torch.randint(0, V, (8, T)); y = torch.randint(0, V, (8, T))
    times = []
    for i in range(opts['warmup'] + opts['steps']):
        dist.barrier()
        t0 = time.perf_counter()
        ddp(x, y).backward()
        opt.step(); opt.zero_grad()
        if i >= opts['warmup']:
            times.append((time.perf_counter() - t0) * 1000)
    state = opt.optim.state if mode == 'zero1' else opt.state
    opt_bytes = sum(t.numel() * t.element_size() for s in state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    out[mode] = {'times': times, 'optimizerBytes': opt_bytes}
print('BENCH ' + json.dumps(out), flush=True)
dist.destroy_process_group()
