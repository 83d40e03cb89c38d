"""A slow, obvious numpy forward pass of the llama architecture: the oracle the engine's
logits are checked against.

Every weight is dequantized to float32 with gguf-py's own dequantizer (independent of our
kernels) and cached per model file, so only the first call pays for it (~1 s, ~550 MB for
SmolLM2-135M). No KV cache, no arena: the whole sequence at once with a causal mask.
"""
from __future__ import annotations

import math
import weakref

import numpy as np
from gguf.quants import dequantize

_DEQUANTIZED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def dequantized(model_file) -> dict[str, np.ndarray]:
    """float32 array of every weight by GGUF name, in numpy shape; cached per ModelFile."""
    weights = _DEQUANTIZED.get(model_file)
    if weights is None:
        weights = {}
        for name, w in model_file.weights().items():
            if w.qtype in ("f32", "f16"):
                arr = w.array()
            else:
                arr = dequantize(w.raw, w.ggml_type)  # [rows, row_bytes] -> [rows, cols]
            weights[name] = np.ascontiguousarray(arr, dtype=np.float32).reshape(w.shape)
        _DEQUANTIZED[model_file] = weights
    return weights


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    # [n_tok, d] -> [n_tok, d]
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
    """Rotate ADJACENT pairs (x[2i], x[2i+1]) of each head by pos * base**(-2i/head_dim).

    This is ggml's "normal" RoPE. HuggingFace llama rotates the two halves of the head
    instead; the GGUF converter permutes the rows of Q and K so that the adjacent-pair form
    gives the same attention scores.
    """
    n_tok, n_heads, head_dim = x.shape
    inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [hd/2]
    angle = positions[:, None].astype(np.float64) * inv_freq[None, :]  # [n_tok, hd/2]
    cos = np.cos(angle)[:, None, :].astype(np.float32)  # [n_tok, 1, hd/2]
    sin = np.sin(angle)[:, None, :].astype(np.float32)
    even, odd = x[..., 0::2], x[..., 1::2]  # [n_tok, heads, hd/2] each
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal grouped-query attention. q [n_tok, n_head, hd], k/v [n_tok, n_kv, hd]."""
    n_tok, n_head, head_dim = q.shape
    group = n_head // k.shape[1]
    k = np.repeat(k, group, axis=1)  # query head h reads kv head h // group
    v = np.repeat(v, group, axis=1)  # [n_tok, n_head, hd]
    scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim)  # [n_head, n_tok, n_tok]
    future = np.triu(np.ones((n_tok, n_tok), dtype=bool), k=1)
    scores[:, future] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, v)  # [n_tok, n_head, hd]


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def reference_logits(model_file, token_ids) -> np.ndarray:
    """Logits at every position: [n_tokens, n_vocab] float32."""
    hp = model_file.hparams
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.ndim != 1 or ids.size == 0 or ids.min() < 0 or ids.max() >= hp.n_vocab:
        raise ValueError(f"token_ids must be a non-empty list of ids in 0..{hp.n_vocab - 1}, "
                         f"got {token_ids!r}")
    W = dequantized(model_file)
    n_tok = ids.size
    positions = np.arange(n_tok)
    x = W["token_embd.weight"][ids]  # [n_tok, d]
    for i in range(hp.n_layer):
        p = f"blk.{i}."
        h = rms_norm(x, W[p + "attn_norm.weight"], hp.rms_eps)
        q = (h @ W[p + "attn_q.weight"].T).reshape(n_tok, hp.n_head, hp.head_dim)
        k = (h @ W[p + "attn_k.weight"].T).reshape(n_tok, hp.n_head_kv, hp.head_dim)
        v = (h @ W[p + "attn_v.weight"].T).reshape(n_tok, hp.n_head_kv, hp.head_dim)
        q = rope(q, positions, hp.rope_freq_base)
        k = rope(k, positions, hp.rope_freq_base)
        att = attention(q, k, v).reshape(n_tok, hp.q_dim)  # [n_tok, n_head * hd]
        x = x + att @ W[p + "attn_output.weight"].T  # [n_tok, q_dim] -> [n_tok, d]
        h = rms_norm(x, W[p + "ffn_norm.weight"], hp.rms_eps)
        gate = h @ W[p + "ffn_gate.weight"].T  # [n_tok, d] -> [n_tok, d_ff]
        up = h @ W[p + "ffn_up.weight"].T
        x = x + (silu(gate) * up) @ W[p + "ffn_down.weight"].T  # [n_tok, d_ff] -> [n_tok, d]
    x = rms_norm(x, W["output_norm.weight"], hp.rms_eps)
    out = W.get("output.weight", W["token_embd.weight"])  # tied when output is absent
    assert x.dtype == np.float32, x.dtype  # a float64 scalar would silently upcast every matmul
    return x @ out.T  # [n_tok, d] -> [n_tok, n_vocab]
