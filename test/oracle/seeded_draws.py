"""torch.manual_seed(seed), then the draws flotilla's test makes, in the same order.
argv: in.safetensors (unused) out.safetensors {"seed": n}."""
import json
import sys

import torch

from st import save

torch.manual_seed(json.loads(sys.argv[3])['seed'])
out = {}
out['randn'] = torch.randn(5, 7)
out['rand'] = torch.rand(20)
out['randint'] = torch.randint(0, 10, (12,))
out['randn64'] = torch.randn(3, 3, dtype=torch.float64)
out['normal_'] = torch.empty(40).normal_(1.0, 0.5)
out['uniform_'] = torch.empty(8).uniform_(-2.0, 2.0)
save(sys.argv[2], out)
