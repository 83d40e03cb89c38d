"""Graph IR: tensors and nodes in execution order.

A graph is what the planner plans and the executor runs. Tensors have a shape in numpy order
(the last axis is the row, so a Q4_1 weight of 1536 rows of 576 is shape (1536, 576)), a dtype
and a kind that tells the planner how long its bytes must live:

    input         written by the caller before node 0; lives until its last reader
    output        written by a node; lives to the end of the graph (the caller reads it after)
    weight        read-only bytes from the model file; never planned
    intermediate  written by one node, read by later ones; lives from writer to last reader
    persistent    exists before node 0 and after the last node (e.g. a KV cache); nodes may
                  update it in place; lives the whole graph
    scratch       a node's private workspace, listed in its outputs; lives at that node only
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Mapping

from .errors import GraphError

# dtype -> (values per block, bytes per block); scalar types are blocks of one value.
# Block types follow ggml: see DESIGN.md "GGUF block formats".
DTYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4),
    "f16": (1, 2),
    "i32": (1, 4),
    "i8": (1, 1),
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q8_0": (32, 34),
    "q8_1": (32, 36),
}
BLOCK_DTYPES = frozenset(name for name, (block, _) in DTYPES.items() if block > 1)
KINDS = ("input", "output", "weight", "intermediate", "persistent", "scratch")
# Kinds whose bytes exist before node 0 (nobody in the graph has to write them first).
PRESET_KINDS = frozenset({"input", "weight", "persistent"})


def row_bytes(n_values: int, dtype: str) -> int:
    """Bytes of one row of n_values elements; block types need a whole number of blocks."""
    block, size = DTYPES[dtype]
    if n_values % block:
        raise GraphError(f"row of {n_values} values is not a multiple of the {dtype} block "
                         f"size ({block})")
    return n_values // block * size


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str = "intermediate"
    layer: int | None = None  # transformer layer it belongs to, for reports and plots

    @property
    def nbytes(self) -> int:
        if not self.shape:
            return DTYPES[self.dtype][1]
        return prod(self.shape[:-1]) * row_bytes(self.shape[-1], self.dtype)


@dataclass(frozen=True)
class Node:
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: Mapping = field(default_factory=dict)
    name: str = ""

    def __str__(self) -> str:
        return self.name or self.op


class Graph:
    """Tensors by name and nodes in execution order. Build with add_tensor / add_node, then
    validate() (the planner calls it)."""

    def __init__(self, name: str = "graph"):
        self.name = name
        self.tensors: dict[str, Tensor] = {}
        self.nodes: list[Node] = []

    def add_tensor(self, name: str, shape, dtype: str = "f32", kind: str = "intermediate",
                   layer: int | None = None) -> str:
        if name in self.tensors:
            raise GraphError(f"tensor {name!r} is defined twice")
        if dtype not in DTYPES:
            raise GraphError(f"tensor {name!r}: unknown dtype {dtype!r}; "
                             f"known: {', '.join(DTYPES)}")
        if kind not in KINDS:
            raise GraphError(f"tensor {name!r}: unknown kind {kind!r}; known: {', '.join(KINDS)}")
        shape = tuple(int(d) for d in shape)
        if any(d <= 0 for d in shape):
            raise GraphError(f"tensor {name!r}: shape {shape} has a dimension <= 0")
        if shape and shape[-1] % DTYPES[dtype][0]:
            raise GraphError(f"tensor {name!r}: shape {shape} has rows of {shape[-1]} values, "
                             f"not a whole number of {dtype} blocks of {DTYPES[dtype][0]}")
        self.tensors[name] = Tensor(name, shape, dtype, kind, layer)
        return name

    def add_node(self, op: str, inputs, outputs, name: str = "", **attrs) -> Node:
        node = Node(op, tuple(inputs), tuple(outputs), dict(attrs),
                    name or f"{op}_{len(self.nodes)}")
        self.nodes.append(node)
        return node

    @property
    def inputs(self) -> list[str]:
        return [t.name for t in self.tensors.values() if t.kind == "input"]

    @property
    def outputs(self) -> list[str]:
        return [t.name for t in self.tensors.values() if t.kind == "output"]

    def validate(self) -> None:
        """Raise GraphError naming the node and tensor for the first broken rule."""
        if not self.nodes:
            raise GraphError(f"graph {self.name!r} has no nodes")
        written: set[str] = set()
        for i, node in enumerate(self.nodes):
            where = f"node {i} ({node})"
            for t in node.inputs:
                tensor = self._known(t, where)
                if tensor.kind == "scratch":
                    raise GraphError(f"{where} reads scratch tensor {t!r}; scratch is private "
                                     "to the node that lists it as an output")
                if tensor.kind not in PRESET_KINDS and t not in written:
                    raise GraphError(f"{where} reads tensor {t!r} before any node writes it")
            for t in node.outputs:
                tensor = self._known(t, where)
                if tensor.kind in ("input", "weight"):
                    raise GraphError(f"{where} writes {tensor.kind} tensor {t!r}, "
                                     "which is read-only inside the graph")
                if tensor.kind != "persistent" and t in written:
                    raise GraphError(f"{where} writes tensor {t!r}, already written by an "
                                     "earlier node (only persistent tensors are updated in place)")
                written.add(t)
        for t in self.outputs:
            if t not in written:
                raise GraphError(f"graph output {t!r} is never written by any node")

    def _known(self, name: str, where: str) -> Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise GraphError(f"{where} uses unknown tensor {name!r}") from None

    def __repr__(self) -> str:
        return f"Graph({self.name!r}, {len(self.tensors)} tensors, {len(self.nodes)} nodes)"


# --- the llama graph ------------------------------------------------------------------------

# Activation block type each weight type is paired with (DESIGN.md "GGUF block formats").
ACT_QTYPE = {"q4_0": "q8_0", "q4_1": "q8_1", "q8_0": "q8_0"}


def kv_cache_names(layer: int) -> tuple[str, str]:
    return f"cache_k.{layer}", f"cache_v.{layer}"


def build_llama_graph(hp, weight_types: Mapping[str, tuple[str, tuple[int, ...]]],
                      n_tokens: int, n_ctx: int, all_logits: bool = False,
                      kv_dtype: str = "f16", n_threads: int = 1) -> Graph:
    """The op graph of a llama-architecture forward pass over n_tokens tokens.

    hp: hyper-parameters (n_layer, n_embd, n_ff, n_head, n_head_kv, head_dim, n_vocab, ...).
    weight_types: GGUF tensor name -> (qtype, numpy shape), for every weight the graph reads.
    The positions are a run-time argument (pos0), so one graph serves every chunk of n_tokens
    tokens (or fewer: the executor runs the first n rows). KV caches are persistent tensors of
    [n_ctx, n_head_kv * head_dim]. With all_logits=False only the last token's logits are
    computed (prefill and decode need nothing else); eval_logits asks for all of them.
    """
    T, d, ff = n_tokens, hp.n_embd, hp.n_ff
    d_q, d_kv = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
    g = Graph(f"llama_T{T}")
    weights: dict[str, str] = {}

    def weight(name: str) -> str:
        if name not in weights:
            qtype, shape = weight_types[name]
            weights[name] = g.add_tensor(name, shape, qtype, "weight")
        return weights[name]

    def t(name, shape, dtype="f32", layer=None, kind="intermediate"):
        return g.add_tensor(name, shape, dtype, kind, layer)

    def linear(w_name, xq, out_name, rows, layer):
        out = t(out_name, (T, rows), layer=layer)
        g.add_node("matmul", [weight(w_name), xq], [out], name=out_name)
        return out

    def quantize(x, w_name, layer):
        """x [T, n] f32 -> [T, n] activation blocks of the type w_name's weight pairs with."""
        act = ACT_QTYPE[weight_types[w_name][0]]
        xq = t(f"{x}.{act}", (g.tensors[x].shape), act, layer)
        g.add_node("quantize", [x], [xq], name=xq)
        return xq

    tokens = t("tokens", (T,), "i32", kind="input")
    x = t("x.0", (T, d), layer=0)
    g.add_node("embed", [weight("token_embd.weight"), tokens], [x], name="embed")
    for i in range(hp.n_layer):
        blk = f"blk.{i}."
        # attention block: x -> x2 = x + W_o attn(rope(W_q h), rope(W_k h), W_v h)
        h = t(f"attn_norm.{i}", (T, d), layer=i)
        g.add_node("rmsnorm", [x, weight(blk + "attn_norm.weight")], [h], name=h)
        hq = quantize(h, blk + "attn_q.weight", i)
        q = linear(blk + "attn_q.weight", hq, f"q.{i}", d_q, i)
        k = linear(blk + "attn_k.weight", hq, f"k.{i}", d_kv, i)
        v = linear(blk + "attn_v.weight", hq, f"v.{i}", d_kv, i)
        qr, kr = t(f"q_rope.{i}", (T, d_q), layer=i), t(f"k_rope.{i}", (T, d_kv), layer=i)
        g.add_node("rope", [q], [qr], name=qr, n_head=hp.n_head)
        g.add_node("rope", [k], [kr], name=kr, n_head=hp.n_head_kv)
        ck, cv = (t(name, (n_ctx, d_kv), kv_dtype, i, "persistent") for name in kv_cache_names(i))
        g.add_node("kv_write", [kr, v], [ck, cv], name=f"kv_write.{i}")
        scores = t(f"scores.{i}", (n_threads, n_ctx), layer=i, kind="scratch")
        attn = t(f"attn.{i}", (T, d_q), layer=i)
        g.add_node("attention", [qr, ck, cv], [attn, scores], name=attn)
        attn_out = linear(blk + "attn_output.weight", quantize(attn, blk + "attn_output.weight", i),
                          f"attn_out.{i}", d, i)
        x2 = t(f"x_mid.{i}", (T, d), layer=i)
        g.add_node("add", [x, attn_out], [x2], name=x2)
        # feed-forward block: x2 -> x2 + W_down (silu(W_gate h2) * W_up h2)
        h2 = t(f"ffn_norm.{i}", (T, d), layer=i)
        g.add_node("rmsnorm", [x2, weight(blk + "ffn_norm.weight")], [h2], name=h2)
        h2q = quantize(h2, blk + "ffn_gate.weight", i)
        gate = linear(blk + "ffn_gate.weight", h2q, f"gate.{i}", ff, i)
        up = linear(blk + "ffn_up.weight", h2q, f"up.{i}", ff, i)
        act = t(f"act.{i}", (T, ff), layer=i)
        g.add_node("silu_mul", [gate, up], [act], name=act)
        down = linear(blk + "ffn_down.weight", quantize(act, blk + "ffn_down.weight", i),
                      f"down.{i}", d, i)
        x = t(f"x.{i + 1}", (T, d), layer=i)
        g.add_node("add", [x2, down], [x], name=x)
    n_out = T if all_logits else 1
    out_w = "output.weight" if "output.weight" in weight_types else "token_embd.weight"
    h = t("output_norm", (n_out, d))
    g.add_node("rmsnorm", [x, weight("output_norm.weight")], [h], name=h, last_only=not all_logits)
    logits = t("logits", (n_out, hp.n_vocab), kind="output")
    g.add_node("matmul", [weight(out_w), quantize(h, out_w, None)], [logits], name="logits")
    g.validate()
    return g
