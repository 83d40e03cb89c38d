"""A slow, obvious numpy forward pass of the llama architecture: the oracle the engine's
logits are checked against.

Every weight is dequantized to float32 with gguf-py's own dequantizer (independent of our
kernels) and cached per model file, so only the first call pays for it (~1 s, ~550 MB for
SmolLM2-135M). No KV cache, no arena: the whole sequence at once with a causal mask.

write_tiny_llama() writes a small random llama GGUF (2 layers, n_embd 64, a 48-token byte-level
vocabulary) for tests that need a whole model file but not the real one's size, or a broken one.
"""
from __future__ import annotations

import math
import weakref

import gguf
import numpy as np
from gguf.quants import dequantize, quantize

_DEQUANTIZED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


# A 150+-token passage of ordinary English for comparing logits (tests and benchmarks).
PASSAGE = (
    "The history of the bicycle begins in the early nineteenth century, when inventors in "
    "Europe built wooden machines that riders pushed along with their feet. Pedals attached "
    "to the front wheel came decades later, and the tall penny-farthing followed, fast but "
    "dangerous. The safety bicycle, with two wheels of equal size and a chain driving the "
    "rear wheel, changed everything in the 1880s. Pneumatic tyres made the ride smooth, and "
    "within a few years millions of people in cities and villages could travel further than "
    "ever before without a horse. Women in particular found a new freedom, and the bicycle "
    "became a symbol of independence. Today engineers still refine frames, gears and brakes, "
    "yet the basic shape has hardly changed in more than a century."
)


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


TINY = dict(n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, n_ctx=256)
# Byte-level vocabulary: three control tokens, single characters ("Ġ" is the space byte,
# "Ċ" the newline), then the results of TINY_MERGES.
TINY_TOKENS = (["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
               + list("abcdefghijklmnopqrstuvwxyz0123456789") + ["Ġ", "Ċ", ".", ",", "!", "?"]
               + ["he", "Ġt", "Ġthe"])
TINY_MERGES = ["h e", "Ġ t", "Ġt he"]
TINY_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def tiny_shapes(n_layer, n_embd, n_ff, n_head, n_head_kv, n_vocab) -> dict:
    """Numpy shape of every tensor of a tied llama model, in the order they are written."""
    head_dim = n_embd // n_head
    shapes = {"token_embd.weight": (n_vocab, n_embd), "output_norm.weight": (n_embd,)}
    for i in range(n_layer):
        p = f"blk.{i}."
        shapes.update({
            p + "attn_norm.weight": (n_embd,), p + "attn_q.weight": (n_embd, n_embd),
            p + "attn_k.weight": (n_head_kv * head_dim, n_embd),
            p + "attn_v.weight": (n_head_kv * head_dim, n_embd),
            p + "attn_output.weight": (n_embd, n_embd), p + "ffn_norm.weight": (n_embd,),
            p + "ffn_gate.weight": (n_ff, n_embd), p + "ffn_up.weight": (n_ff, n_embd),
            p + "ffn_down.weight": (n_embd, n_ff)})
    return shapes


def write_tiny_llama(path, seed: int = 0, layer_type: str = "q4_1", embd_type: str = "q8_0",
                     output_type: str | None = None, arch: str = "llama", types=None,
                     shapes=None, drop=(), **hparams) -> dict[str, np.ndarray]:
    """Write a random llama-architecture GGUF to path; return the float32 values written.

    layer_type / embd_type: types of the block matrices and of token_embd; output_type: give an
    untied output.weight of that type (None: tied). types / shapes: per-tensor overrides by
    name; drop: names to leave out. hparams override TINY (n_layer, n_embd, ...; vocab_size
    writes that key, which is otherwise left out).
    """
    hp = {**TINY, **hparams}
    rng = np.random.default_rng(seed)
    n_vocab = len(TINY_TOKENS)
    want = tiny_shapes(hp["n_layer"], hp["n_embd"], hp["n_ff"], hp["n_head"], hp["n_head_kv"],
                       n_vocab)
    if output_type is not None:
        want["output.weight"] = (n_vocab, hp["n_embd"])
    want.update(shapes or {})
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-llama")
    w.add_block_count(hp["n_layer"])
    w.add_context_length(hp["n_ctx"])
    w.add_embedding_length(hp["n_embd"])
    w.add_feed_forward_length(hp["n_ff"])
    w.add_head_count(hp["n_head"])
    w.add_head_count_kv(hp["n_head_kv"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    if "vocab_size" in hp:
        w.add_vocab_size(hp["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TINY_TOKENS)
    w.add_token_merges(TINY_MERGES)
    w.add_token_types([3, 3, 3] + [1] * (n_vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TINY_TEMPLATE)
    values = {}
    for name, shape in want.items():
        if name in drop:
            continue
        if len(shape) == 1:
            qtype, arr = "f32", 1.0 + 0.1 * rng.standard_normal(shape)  # norm weights near 1
        else:
            qtype = embd_type if name in ("token_embd.weight",) else \
                output_type if name == "output.weight" else layer_type
            arr = rng.standard_normal(shape) / np.sqrt(shape[-1])  # unit-ish activations
        qtype = (types or {}).get(name, qtype)
        arr = arr.astype(np.float32)
        ggml_type = gguf.GGMLQuantizationType[qtype.upper()]
        if qtype == "f32":
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, quantize(arr, ggml_type), raw_dtype=ggml_type)
        values[name] = arr
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return values
