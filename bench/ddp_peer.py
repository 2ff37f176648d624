# PyTorch peer of bench/ddp_rank.ts: the same GPT math, DistributedDataParallel over Gloo with the
# same bucket size, one intra-op thread. Prints one JSON line per rank.
import json, math, os, sys, time
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

opts = json.loads(sys.argv[1])
torch.set_num_threads(1)
dist.init_process_group('gloo')
rank = dist.get_rank()
V, T, L, H, C = 256, 128, 4, 8, 256


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(C); self.qkv = nn.Linear(C, 3 * C); self.proj = nn.Linear(C, C)
        self.ln2 = nn.LayerNorm(C); self.fc = nn.Linear(C, 4 * C); self.fc2 = nn.Linear(4 * C, C)
        self.mask = torch.ones(T, T, dtype=torch.bool).tril()  # not a buffer: Gloo cannot broadcast bool

    def forward(self, x):
        B, t, _ = x.shape
        hs = C // H
        q, k, v = self.qkv(self.ln1(x)).split(C, 2)
        q, k, v = (z.view(B, t, H, hs).transpose(1, 2) for z in (q, k, v))
        a = (q @ k.transpose(-2, -1)) * (1 / math.sqrt(hs))
        a = a.masked_fill(~self.mask[:t, :t], float('-inf')).softmax(-1)
        x = x + self.proj((a @ v).transpose(1, 2).contiguous().view(B, t, C))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, C); self.wpe = nn.Embedding(T, C)
        self.h = nn.ModuleList([Block() for _ in range(L)])
        self.ln = nn.LayerNorm(C); self.head = nn.Linear(C, V, bias=False)

    def forward(self, idx, tgt):
        B, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for b in self.h:
            x = b(x)
        return F.cross_entropy(self.head(self.ln(x)).view(B * t, V), tgt.reshape(B * t))


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
