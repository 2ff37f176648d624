"""Which layers of a Hugging Face config attend through a sliding window, as transformers' configs decide it
(from their published source): Mistral and Mixtral window every layer with sliding_window (None = none);
Qwen2, Qwen3 and Qwen3-MoE keep sliding_window only with use_sliding_window, and layer i is
"sliding_attention" when layer_types says so, or (no layer_types) when sliding_window is set and
i >= max_window_layers (default 28)."""
import torch


def layer_window(c, i):
    """Layer i's window (None = full causal attention)."""
    if c['model_type'] in ('mistral', 'mixtral'):
        return c.get('sliding_window')
    if c['model_type'] in ('qwen2', 'qwen3', 'qwen3_moe'):
        w = c.get('sliding_window') if c.get('use_sliding_window', False) else None
        if w is None:
            return None
        types = c.get('layer_types')
        if types is None:
            types = ['sliding_attention' if i2 >= c.get('max_window_layers', 28) else 'full_attention' for i2 in range(c['num_hidden_layers'])]
        return w if types[i] == 'sliding_attention' else None
    return None


def layer_mask(c, i, T):
    """(T, T) bool: query q reads key k when k <= q and (with layer i's window W) q - k < W."""
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    W = layer_window(c, i)
    if W is None:
        return causal
    qi, kj = torch.arange(T)[:, None], torch.arange(T)[None, :]
    return causal & (kj > qi - W)
