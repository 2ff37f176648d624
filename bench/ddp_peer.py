# PyTorch peer of bench/ddp_rank.ts: the same GPT math, DistributedDataParallel over Gloo with the
# same bucket size, one intra-op thread. Prints one JSON line per rank.
import json, os, sys, time
import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))
from peer_gpt import GPT, V, T  # noqa: E402

opts = json.loads(sys.argv[1])
# precision 'bf16-mixed': the forward under torch.autocast('cpu', dtype=torch.bfloat16) (bench/precision_ddp.ts).
AMP = opts.get('precision', 'fp32') == 'bf16-mixed'
torch.set_num_threads(1)
dist.init_process_group('gloo')
rank = dist.get_rank()
torch.manual_seed(0)
model = GPT()
ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=opts['bucketMb'])
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
torch.manual_seed(1 + rank)
x = torch.randint(0, V, (8, T)); y = torch.randint(0, V, (8, T))


def synced_step():
    """[whole step, optimizer step] in ms."""
    t0 = time.perf_counter()
    opt.zero_grad()
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=AMP):
        loss = ddp(x, y)
    loss.backward()
    t1 = time.perf_counter()
    opt.step()
    t2 = time.perf_counter()
    return (t2 - t0) * 1000, (t2 - t1) * 1000


def local_pass():
    """Forward and backward under no_sync, in ms; a compute-only step adds the synced steps' optimizer
    time (timed as bench/ddp_rank.ts times flotilla)."""
    t0 = time.perf_counter()
    opt.zero_grad()
    with ddp.no_sync():
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=AMP):
            loss = ddp(x, y)
        loss.backward()
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


synced, passes, opt_ms = [], [], []
main_cpu = other_cpu = 0.0
for _ in range(opts['warmup']):
    synced_step()
for _ in range(opts['steps']):
    total, o = synced_step()
    synced.append(total); opt_ms.append(o); dist.barrier()
    before = thread_cpu()
    passes.append(local_pass())
    for tid, ms in thread_cpu().items():
        d = ms - before.get(tid, 0.0)
        if tid == os.getpid():
            main_cpu += d
        else:
            other_cpu += d
    dist.barrier()
opt_median = sorted(opt_ms)[len(opt_ms) // 2]
local = [p + opt_median for p in passes]
cpu = {'main': main_cpu / opts['steps'], 'other': other_cpu / opts['steps']}
print('BENCH ' + json.dumps({'rank': rank, 'synced': synced, 'local': local, 'opt': opt_ms, 'cpu': cpu,
                             'params': sum(p.numel() for p in model.parameters())}), flush=True)
dist.destroy_process_group()
