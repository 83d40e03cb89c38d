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
