"""Runs a planned llama graph over its arena with the compiled kernels.

The graph's nodes are compiled once into a flat op table of raw pointers (arena offsets, KV
cache rows, memory-mapped weights) and run from Cython in one call per forward pass: the token
loop makes no Python call per op and allocates nothing. Every pointer and size is checked
here, because the compiled code runs with bounds checks off.
"""
from __future__ import annotations

import math

import numpy as np

from ._ext.kernels import Q8_1, QTYPES, Program
from .arena import Arena, aligned_zeros
from .errors import GraphError
from .graph import Graph, kv_cache_names, row_bytes
from .planner import GraphPlan

# Kernel type ids: the weight types are the kernels' own table; activations are Q8_0 / Q8_1.
WEIGHT_QTYPES = QTYPES
ACT_QTYPES = {"q8_0": QTYPES["q8_0"], "q8_1": Q8_1}
# Ops whose token row t is computed, in every such op, by the thread that owns row t.
ROW_LOCAL_OPS = frozenset({"embed", "rmsnorm", "quantize", "rope", "kv_write", "add", "silu_mul"})


class KVStore:
    """K and V caches of every layer: [n_ctx, n_head_kv * head_dim] each, f16 or f32."""

    def __init__(self, n_layer: int, n_ctx: int, d_kv: int, dtype: str = "f16"):
        if dtype not in ("f16", "f32"):
            raise ValueError(f"KV cache dtype {dtype!r} is not supported; use 'f16' or 'f32'")
        self.dtype, self.n_ctx = dtype, n_ctx
        np_dtype = np.float16 if dtype == "f16" else np.float32
        # [n_layer] x [n_ctx, d_kv]
        self.k = [aligned_zeros((n_ctx, d_kv), np_dtype) for _ in range(n_layer)]
        self.v = [aligned_zeros((n_ctx, d_kv), np_dtype) for _ in range(n_layer)]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)

    def bytes_for(self, n_positions: int) -> int:
        return self.nbytes * n_positions // self.n_ctx

    def bind(self, arena: Arena) -> None:
        for i, (k, v) in enumerate(zip(self.k, self.v)):
            k_name, v_name = kv_cache_names(i)
            arena.bind(k_name, k)
            arena.bind(v_name, v)


class Executor:
    """One planned graph, its arena and its compiled op table.

    run(tokens, pos0) feeds n <= T token ids at positions pos0.. and returns the logits view
    (rows: every token if the graph was built with all_logits, else the last one).
    """

    def __init__(self, model, plan: GraphPlan, kv: KVStore, max_threads: int = 1,
                 sanitize: bool = False):
        self.plan, self.graph, self.kv = plan, plan.graph, kv
        self.n_tokens = self.graph.tensors["tokens"].shape[0]
        self.sanitize = sanitize
        self.arena = Arena(plan, sanitize=sanitize)
        kv.bind(self.arena)
        self._tokens = self.arena.view("tokens")  # [T] int32
        self._logits = self.arena.view("logits")  # [1 or T, n_vocab] float32
        self.n_vocab = self._logits.shape[1]
        self.hp = model.hparams
        self._weights: dict[str, np.ndarray] = {}
        self.program_threads = max_threads
        specs = [self._compile(i, node, model) for i, node in enumerate(self.graph.nodes)]
        for spec, sync in zip(specs, self._barriers(specs)):
            spec["sync"] = int(sync)
        self.n_barriers = sum(spec["sync"] for spec in specs)
        self.program = Program(specs, self.n_tokens, kv.n_ctx, max_threads,
                               (self.arena, kv, self._weights))

    def run(self, tokens, pos0: int, n_threads: int = 1) -> np.ndarray:
        """Forward pass over `tokens` (ids, n <= T) at positions pos0...; returns the logits
        rows in use: [n, n_vocab] for an all-logits graph, else [1, n_vocab] (last token)."""
        n = len(tokens)
        if not 1 <= n <= self.n_tokens:
            raise ValueError(f"{n} tokens given; this plan runs 1..{self.n_tokens} at a time")
        for t in tokens:
            if not 0 <= t < self.n_vocab:
                raise ValueError(f"token id {t} is outside the vocabulary 0..{self.n_vocab - 1}")
        self._tokens[:n] = tokens
        if self.sanitize:
            for i in range(len(self.graph.nodes)):
                self.program.run(n, pos0, n_threads, i, i + 1)
                self.arena.after_node(i)
        else:
            self.program.run(n, pos0, n_threads)
        return self._logits[:n] if self._logits.shape[0] == self.n_tokens > 1 else self._logits

    # --- where the threads must meet ---------------------------------------------------------

    def _barriers(self, specs) -> list[bool]:
        """After which ops all threads must meet. Ops since the last barrier form a group that
        threads run without waiting for one another, so an op joins the group only if it
        touches no byte that an op of the group writes, and writes no byte that one reads:
        with arena reuse that is a question of byte ranges, not tensor names. Exception: ops
        that each run entirely on one thread (row-wise ops over a single token row: the split
        in runtime.pxi gives that row to the same thread every time) are ordered among
        themselves anyway. On a decode step this removes half of the barriers."""
        group, barriers = [], []
        for node, spec in zip(self.graph.nodes, specs):
            access = self._access(node, spec)
            if any(_conflict(done, access) for done in group):
                barriers[-1] = True
                group = []
            group.append(access)
            barriers.append(False)
        barriers[-1] = True
        return barriers

    def _access(self, node, spec) -> tuple[list, list, bool]:
        """(byte ranges read, byte ranges written, runs on one thread alone) of one op."""
        def span(name):
            return self.arena.address(name), self.graph.tensors[name].nbytes
        reads = [span(n) for n in node.inputs if self.graph.tensors[n].kind != "weight"]
        writes = [span(n) for n in node.outputs]
        rows = spec.get("fixed_tok", self.n_tokens)
        last_row_only = node.attrs.get("last_only", False) and self.n_tokens > 1
        alone = node.op in ROW_LOCAL_OPS and rows == 1 and not last_row_only
        return reads, writes, alone

    # --- compiling nodes into op specs -------------------------------------------------------

    def _weight(self, model, name: str) -> int:
        w = model.weight(name)
        expected = self.graph.tensors[name]
        if w.qtype != expected.dtype or tuple(w.shape) != expected.shape:
            raise GraphError(f"weight {name!r} is {w.qtype}{tuple(w.shape)} in the model but "
                             f"{expected.dtype}{expected.shape} in the graph")
        arr = w.raw if w.qtype in WEIGHT_QTYPES else w.array()
        if not arr.flags.c_contiguous:
            raise GraphError(f"weight {name!r} is not contiguous in the model file")
        self._weights[name] = arr
        return arr.ctypes.data

    def _tensor(self, name: str) -> tuple[int, int]:
        """(address, bytes per row) of an arena or KV tensor."""
        t = self.graph.tensors[name]
        return self.arena.address(name), row_bytes(t.shape[-1], t.dtype) if t.shape else 0

    def _compile(self, index: int, node, model) -> dict:
        g, hp = self.graph, self.hp
        ins, outs = node.inputs, node.outputs
        spec = {"kind": node.op}

        def operand(slot: str, name: str):
            spec[slot], spec[slot + "_stride"] = self._tensor(name)

        token_rows = ins[1] if node.op in ("embed", "matmul") else ins[0]
        rows = g.tensors[token_rows].shape[0]
        if rows != self.n_tokens:
            spec["fixed_tok"] = rows
        if node.op == "embed":
            operand("a", ins[1])
            spec["b"], spec["b_stride"] = self._weight(model, ins[0]), model.weight(ins[0]).raw.shape[1]
            spec["qtype"] = self._weight_qtype(ins[0], node)
            operand("c", outs[0])
            spec["n"], spec["rows"] = g.tensors[outs[0]].shape[-1], g.tensors[ins[0]].shape[0]
        elif node.op == "rmsnorm":
            operand("a", ins[0])
            spec["b"] = self._weight(model, ins[1])
            operand("c", outs[0])
            spec.update(n=g.tensors[outs[0]].shape[-1], eps=hp.rms_eps,
                        flag=int(node.attrs.get("last_only", False)))
        elif node.op == "quantize":
            operand("a", ins[0])
            operand("c", outs[0])
            spec.update(n=g.tensors[ins[0]].shape[-1], qtype=ACT_QTYPES[g.tensors[outs[0]].dtype])
        elif node.op == "matmul":
            w, x = g.tensors[ins[0]], g.tensors[ins[1]]
            if w.shape[1] != x.shape[-1] or g.tensors[outs[0]].shape[-1] != w.shape[0]:
                raise GraphError(f"node {index} ({node}): weight {w.name} {w.shape} does not "
                                 f"match input {x.name} {x.shape} / output {outs[0]}")
            operand("a", ins[1])
            spec["b"], spec["b_stride"] = self._weight(model, ins[0]), row_bytes(w.shape[1], w.dtype)
            operand("c", outs[0])
            spec.update(n=w.shape[1], rows=w.shape[0], qtype=self._weight_qtype(ins[0], node))
        elif node.op == "rope":
            operand("a", ins[0])
            operand("c", outs[0])
            spec.update(n=g.tensors[ins[0]].shape[-1], n_head=node.attrs["n_head"],
                        head_dim=hp.head_dim, freq_base=hp.rope_freq_base)
        elif node.op == "kv_write":
            operand("a", ins[0])
            operand("b", ins[1])
            operand("c", outs[0])
            operand("d", outs[1])
            spec.update(n=g.tensors[ins[0]].shape[-1], flag=int(self.kv.dtype == "f16"))
        elif node.op == "attention":
            operand("a", ins[0])
            operand("b", ins[1])
            operand("d", ins[2])
            operand("c", outs[0])
            operand("s", outs[1])
            spec.update(n_head=hp.n_head, n_kv_head=hp.n_head_kv, head_dim=hp.head_dim,
                        scale=1.0 / math.sqrt(hp.head_dim), flag=int(self.kv.dtype == "f16"))
            rows, length = g.tensors[outs[1]].shape
            if length < self.kv.n_ctx or rows < self.program_threads:
                raise GraphError(f"attention scratch {outs[1]} is {rows} x {length}; it needs a "
                                 f"row per thread ({self.program_threads}) of the context length "
                                 f"({self.kv.n_ctx})")
        elif node.op in ("add", "silu_mul"):
            operand("a", ins[0])
            operand("b", ins[1])
            operand("c", outs[0])
            spec["n"] = g.tensors[outs[0]].shape[-1]
        else:
            raise GraphError(f"node {index} ({node}): op {node.op!r} has no kernel")
        return spec

    def _weight_qtype(self, name: str, node) -> int:
        dtype = self.graph.tensors[name].dtype
        if dtype not in WEIGHT_QTYPES:
            raise GraphError(f"node {node}: weight {name!r} has type {dtype}; the kernels take "
                             f"{', '.join(WEIGHT_QTYPES)}")
        return WEIGHT_QTYPES[dtype]


def _overlap(a, b) -> bool:
    return any(x < y + m and y < x + n for x, n in a for y, m in b)


def _conflict(first, then) -> bool:
    """Must `then` wait for every thread to finish `first`? (read-after-write, write-after-read,
    write-after-write on any byte), unless both run alone on the same thread."""
    (r1, w1, alone1), (r2, w2, alone2) = first, then
    if alone1 and alone2:
        return False
    return _overlap(w1, r2) or _overlap(w1, w2) or _overlap(r1, w2)
