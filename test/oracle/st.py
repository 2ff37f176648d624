"""safetensors read/write for the oracle scripts: a header parse and torch.frombuffer, nothing else."""
import json
import struct

import torch

DTYPES = {
    'F32': torch.float32, 'F64': torch.float64, 'BF16': torch.bfloat16, 'F16': torch.float16,
    'I64': torch.int64, 'I32': torch.int32, 'I16': torch.int16, 'I8': torch.int8, 'U8': torch.uint8, 'BOOL': torch.bool,
}
NAMES = {v: k for k, v in DTYPES.items()}


def load(path):
    """Returns ({name: tensor} in file order, metadata)."""
    with open(path, 'rb') as f:
        raw = f.read()
    (n,) = struct.unpack('<Q', raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop('__metadata__', {})
    out = {}
    for name, e in sorted(header.items(), key=lambda kv: kv[1]['data_offsets'][0]):
        begin, end = e['data_offsets']
        dtype = DTYPES[e['dtype']]
        if end == begin:
            out[name] = torch.empty(e['shape'], dtype=dtype)
        else:
            out[name] = torch.frombuffer(bytearray(raw[8 + n + begin:8 + n + end]), dtype=dtype).reshape(e['shape'])
    return out, meta


def save(path, tensors, meta=None):
    header, blobs, offset = {}, [], 0
    if meta:
        header['__metadata__'] = meta
    for name, t in tensors.items():
        t = t.detach().contiguous()
        b = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {'dtype': NAMES[t.dtype], 'shape': list(t.shape), 'data_offsets': [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header).encode()
    h += b' ' * (-len(h) % 8)
    with open(path, 'wb') as f:
        f.write(struct.pack('<Q', len(h)) + h + b''.join(blobs))
