"""A Qwen3 causal LM in plain torch, for device checks on machines without transformers
(`dlite.bench.device`): random weights at any Qwen3 shape (Qwen3-4B's is
`dlite.bench.shape_rehearsal.QWEN3_4B`), nothing downloaded.

It computes what transformers' Qwen3ForCausalLM computes -- same module names, so a
state dict moves between the two unchanged (`tests/unit/test_device_check.py` compares
their logits): RMSNorm on q and k per head before RoPE, grouped-query attention,
SwiGLU MLP, final norm, lm_head tied to the embedding when the shape says so. It
offers the surface dlite's decoding and capture code reads from a HF target:
`model.model.layers` (hooks), `forward(input_ids, position_ids, past_key_values,
use_cache, logits_to_keep).logits`, `model.model(...).last_hidden_state`,
`get_input_embeddings()` / `get_output_embeddings()`, `config.vocab_size`, and
`new_cache()`, which `dlite.decoding.decode.new_cache` prefers to transformers'
DynamicCache.

Attention: a prefill (more than `FEW_QUERIES` queries) goes through torch's fused
`scaled_dot_product_attention` (flash on a GPU in bf16); a decode step or a verification
block multiplies its few queries, grouped by KV head, with the cached keys directly, so
a step reads the KV cache once and never copies it per query head. The cache keeps
spare room (`KVCache`): a step writes its rows in place, as a serving engine's cache
does, instead of concatenating the whole cache as DynamicCache does. Eager torch
otherwise (no CUDA graphs, no fused kernels): short-context steps are bound by kernel
launches, so they are an upper bound on what a serving engine pays."""

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

FEW_QUERIES = 16  # up to this many queries per forward: the grouped product, not SDPA


class CacheLayer:
    """One layer's key/value buffers [1, kv_heads, capacity, head_dim] and how many
    positions of them are live (`keys` / `values`, as a DynamicCache layer names them)."""

    def __init__(self):
        self.keys = self.values = None
        self.length = 0

    def update(self, k: torch.Tensor, v: torch.Tensor):
        start, n = self.length, k.shape[2]
        if self.keys is None or self.keys.shape[2] < start + n:
            # Room for a quarter more (at least 256 positions): a long decode reallocates
            # rarely, and a prefill's buffers are not grown again by its first steps.
            cap = start + n + max(256, (start + n) // 4)
            self.keys, self.values = _grown(self.keys, k, start, cap), _grown(self.values, v, start, cap)
        self.keys[:, :, start:start + n] = k
        self.values[:, :, start:start + n] = v
        self.length = start + n
        return self.keys[:, :, :self.length], self.values[:, :, :self.length]


def _grown(buf, like: torch.Tensor, keep: int, cap: int) -> torch.Tensor:
    out = like.new_empty(like.shape[0], like.shape[1], cap, like.shape[3])
    if buf is not None and keep:
        out[:, :, :keep] = buf[:, :, :keep]
    return out


class KVCache:
    """The DynamicCache surface dlite uses (`get_seq_length`, `crop(-n)`, `update`,
    `layers[i].keys / .values`), over buffers written in place."""

    def __init__(self, n_layers: int):
        self.layers = [CacheLayer() for _ in range(n_layers)]

    def get_seq_length(self, layer: int = 0) -> int:
        return self.layers[layer].length

    def crop(self, n: int) -> None:
        """n < 0 drops the last -n positions (DynamicCache 5.x); n >= 0 keeps the first n."""
        for c in self.layers:
            c.length = max(0, c.length + n) if n < 0 else min(c.length, n)

    def update(self, k: torch.Tensor, v: torch.Tensor, layer: int):
        """Append k, v [1, kv_heads, n, head_dim]; return the layer's live keys and values."""
        return self.layers[layer].update(k, v)


class RMSNorm(nn.Module):
    """Qwen3RMSNorm: normalised in fp32, cast back, then scaled."""

    def __init__(self, dim: int, eps: float, **kw):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim, **kw)), eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope(x, cos, sin):
    """Rotate-half RoPE (HF convention) with cos / sin [1, 1, n, head_dim] in x's dtype."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def causal_mask(n: int, total: int, start: int, device) -> torch.Tensor:
    """[n, total] bool: query i (position start+i) sees keys 0..start+i."""
    return torch.arange(total, device=device)[None] <= torch.arange(start, start + n, device=device)[:, None]


def grouped_attention(q, k, v, start: int) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v for few queries: q [1, H, n, d] grouped as [1, Hkv, g*n,
    d] against k, v [1, Hkv, T, d], fp32 softmax (HF's eager rule)."""
    b, h, n, d = q.shape
    hkv, total = k.shape[1], k.shape[2]
    g = h // hkv
    s = torch.matmul(q.reshape(b, hkv, g * n, d), k.transpose(-1, -2)).float() * d ** -0.5
    if n > 1:  # a verification block: causal inside the block
        s = s.masked_fill(~causal_mask(n, total, start, q.device).repeat(g, 1), float("-inf"))
    return torch.matmul(torch.softmax(s, -1).to(v.dtype), v).reshape(b, h, n, d)


def attention(q, k, v, start: int, key_mask=None) -> torch.Tensor:
    """Few queries: `grouped_attention`; a prefill: SDPA over KV heads repeated to the
    query heads (the fused kernels' GQA support varies by torch version and backend)."""
    n, total = q.shape[2], k.shape[2]
    if n <= FEW_QUERIES and key_mask is None:
        return grouped_attention(q, k, v, start)
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    if key_mask is None and start == 0 and n == total:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = causal_mask(n, total, start, q.device)[None, None]
    if key_mask is not None:  # padding: [B, total], 1 on real tokens
        mask = mask & key_mask.bool()[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Attention(nn.Module):
    def __init__(self, c, layer: int, **kw):
        super().__init__()
        self.layer, self.heads, self.kv_heads, self.head_dim = (layer, c.num_attention_heads,
                                                                c.num_key_value_heads, c.head_dim)
        self.q_proj = nn.Linear(c.hidden_size, self.heads * c.head_dim, bias=False, **kw)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * c.head_dim, bias=False, **kw)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * c.head_dim, bias=False, **kw)
        self.o_proj = nn.Linear(self.heads * c.head_dim, c.hidden_size, bias=False, **kw)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, **kw)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, **kw)

    def forward(self, x, cos, sin, cache, start: int, key_mask=None):
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, n, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer)
        o = attention(q, k, v, start, key_mask)
        return self.o_proj(o.transpose(1, 2).reshape(b, n, -1))


class MLP(nn.Module):
    def __init__(self, c, **kw):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False, **kw)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False, **kw)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False, **kw)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP with residuals; returns the hidden states (a plain
    tensor, as transformers 5.x's Qwen3DecoderLayer: what capture hooks read)."""

    def __init__(self, c, layer: int, **kw):
        super().__init__()
        self.self_attn, self.mlp = Attention(c, layer, **kw), MLP(c, **kw)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, **kw)

    def forward(self, x, cos, sin, cache, start: int, key_mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, start, key_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    """The decoder stack (`model.model` of the causal LM)."""

    def __init__(self, c, **kw):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, **kw)
        self.layers = nn.ModuleList(DecoderLayer(c, i, **kw) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, **kw)
        theta, dims = c.rope_parameters["rope_theta"], torch.arange(0, c.head_dim, 2, device=kw.get("device"))
        # fp32 whatever the weights' dtype, and not in the state dict (as in transformers)
        self.register_buffer("inv_freq", 1.0 / theta ** (dims.float() / c.head_dim), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=None):
        dev = self.embed_tokens.weight.device
        # Inputs follow the weights (collection code hands CPU token ids to any target).
        ids = input_ids.to(dev)
        start = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(start, start + ids.shape[1], device=dev)[None]
        freqs = position_ids.to(dev)[..., None].float() * self.inv_freq.float()
        emb = torch.cat([freqs, freqs], -1)[:, None]
        x = self.embed_tokens(ids)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        key_mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            key_mask = attention_mask.to(dev)
        for layer in self.layers:
            x = layer(x, cos, sin, past_key_values, start, key_mask)
        return SimpleNamespace(last_hidden_state=self.norm(x))


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, c, **kw):
        super().__init__()
        self.config, self.model = c, Qwen3Model(c, **kw)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False, **kw)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def new_cache(self) -> KVCache:
        return KVCache(self.config.num_hidden_layers)

    def forward(self, input_ids, position_ids=None, past_key_values=None, use_cache=None,
                logits_to_keep: int = 0, attention_mask=None):
        h = self.model(input_ids, attention_mask, position_ids, past_key_values).last_hidden_state
        keep = h[:, -logits_to_keep:] if logits_to_keep else h
        return SimpleNamespace(logits=self.lm_head(keep))


def build(shape: dict, device="cpu", dtype=torch.bfloat16, seed: int = 0) -> Qwen3ForCausalLM:
    """A random-weight Qwen3 of `shape` (Qwen3Config field names), built on `device` in
    `dtype`, initialised as transformers initialises one: linears and the embedding
    Normal(0, 0.02), norms one."""
    c = SimpleNamespace(model_type="qwen3", **shape)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(c, device=device, dtype=dtype)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.normal_(0.0, shape.get("initializer_range", 0.02))
    return model.eval().requires_grad_(False)
