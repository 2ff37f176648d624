# The PyTorch peer of bench/allreduce.ts: the same all-reduce timing loop on torch.distributed's
# c10d Gloo backend. Started by `flotilla run`, which sets RANK, WORLD_SIZE, MASTER_ADDR and
# MASTER_PORT; argv[1] is the same JSON plan the flotilla ranks get. Rank 0 prints one JSON line.
import json
import os
import sys
import time

import torch
import torch.distributed as dist

plan = json.loads(sys.argv[1])
torch.set_num_threads(1)
if os.environ.get("MASTER_ADDR", "127.0.0.1").startswith("127.") and "GLOO_SOCKET_IFNAME" not in os.environ:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # the loopback device, as the flotilla ranks use
dist.init_process_group("gloo", init_method="env://")

best = []
for nbytes, iters in zip(plan["sizes"], plan["iters"]):
    t = torch.ones(nbytes // 4, dtype=torch.float32)
    for _ in range(plan["warmup"]):
        dist.all_reduce(t)
    low = float("inf")
    for _ in range(plan["rounds"]):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        low = min(low, (time.perf_counter() - t0) / iters)
    best.append(low)

if dist.get_rank() == 0:
    print("BENCH " + json.dumps({"impl": "torch", "worldSize": dist.get_world_size(), "seconds": best, "torch": torch.__version__}), flush=True)
dist.destroy_process_group()
