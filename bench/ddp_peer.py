# PyTorch peer of bench/ddp_rank.ts: the same GPT math, DistributedDataParallel over Gloo with the
# same bucket size, one intra-op thread. Prints one JSON line per rank.
import json, os, sys, time
import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))
from peer_gpt import GPT, V, T  # noqa: E402

opts = json.loads(sys.argv[1])
torch.set_num_threads(1)
dist.init_process_group('gloo')
rank = dist.get_rank()
torch.manual_seed(0)
model = GPT()
ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=opts['bucketMb'])
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
torch.manual_seed(1 + rank)
x = torch.randint(0, V, (8, T)); y = torch.randint(0, V, (8, T))


def step(sync):
    t0 = time.perf_counter()
    if sync:
        ddp(x, y).backward()
    else:
        with ddp.no_sync():
            ddp(x, y).backward()
    opt.step(); opt.zero_grad()
    return (time.perf_counter() - t0) * 1000


def thread_cpu():
    """CPU milliseconds each thread of this process has run, by thread id (as bench/ddp_rank.ts)."""
    out = {}
    for t in os.listdir('/proc/self/task'):
        try:
            with open(f'/proc/self/task/{t}/schedstat') as f:
                out[int(t)] = int(f.read().split()[0]) / 1e6
        except OSError:
            pass
    return out


synced, local = [], []
main_cpu = other_cpu = 0.0
for _ in range(opts['warmup']):
    step(True)
for _ in range(opts['steps']):
    synced.append(step(True)); dist.barrier()
    before = thread_cpu()
    local.append(step(False))
    for tid, ms in thread_cpu().items():
        d = ms - before.get(tid, 0.0)
        if tid == os.getpid():
            main_cpu += d
        else:
            other_cpu += d
    dist.barrier()
cpu = {'main': main_cpu / opts['steps'], 'other': other_cpu / opts['steps']}
print('BENCH ' + json.dumps({'rank': rank, 'synced': synced, 'local': local, 'cpu': cpu,
                             'params': sum(p.numel() for p in model.parameters())}), flush=True)
dist.destroy_process_group()
