"""Memory planning: liveness of every tensor, then an offset for each in ONE arena.

Pure: integers in, a frozen plan out, no I/O. Node indices are inclusive: a buffer with
first=2, last=4 is live at nodes 2, 3 and 4, so a node's inputs and outputs never share bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

from .graph import Graph


@dataclass(frozen=True)
class Buffer:
    id: object
    size: int
    first: int
    last: int


@dataclass(frozen=True)
class Plan:
    offsets: dict  # buffer id -> byte offset
    arena_size: int
    lower_bound: int
    strategy: str
    fits: bool | None = None  # set when a capacity was given


@dataclass(frozen=True)
class GraphPlan:
    graph: Graph
    offsets: dict[str, int]  # planned tensor name -> arena offset
    sizes: dict[str, int]  # planned tensor name -> bytes (Tensor.nbytes, unaligned)
    lifetimes: dict[str, tuple[int, int]]  # every non-weight tensor, inclusive node range
    arena_size: int
    lower_bound: int
    external: tuple[str, ...]  # buffer-handle tensors: bound at run time, not in the arena
    strategy: str
    alignment: int
    preserve_all: bool


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def liveness(graph: Graph) -> dict[str, tuple[int, int]]:
    """(first, last) node index per non-weight tensor, inclusive, TFLite semantics."""
    graph.validate()
    end = len(graph.nodes) - 1
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for t in graph.tensors.values():
        if t.kind in ("input", "persistent"):
            first[t.name] = 0
            last[t.name] = end if t.kind == "persistent" else 0
    for i, node in enumerate(graph.nodes):
        for name in node.outputs:
            first.setdefault(name, i)
            last[name] = max(last.get(name, i), i)
        for name in node.inputs:
            if name in first:  # weights have no entry
                last[name] = i
    for t in graph.tensors.values():
        if t.kind == "output":
            last[t.name] = end
    return {name: (first[name], last[name]) for name in first}


def lower_bound(buffers, alignment: int = 64) -> int:
    """Max over nodes of the aligned bytes live at that node: no plan can be smaller."""
    events: dict[int, int] = {}
    for b in buffers:
        size = align_up(b.size, alignment)
        events[b.first] = events.get(b.first, 0) + size
        events[b.last + 1] = events.get(b.last + 1, 0) - size
    live = peak = 0
    for t in sorted(events):
        live += events[t]
        peak = max(peak, live)
    return peak


def place(buffers, alignment: int = 64, strategy: str = "best", capacity=None,
          time_limit_s: float = 10.0) -> Plan:
    """Greedy by size (TFLite ArenaPlanner order); the other strategies come with the planner
    work."""
    buffers = list(buffers)
    order = sorted(buffers, key=lambda b: (-b.size, b.first, str(b.id)))
    placed: list[tuple[int, int, Buffer]] = []  # (offset, aligned size, buffer)
    offsets = {}
    for b in order:
        size = align_up(b.size, alignment)
        busy = sorted((off, off + sz) for off, sz, o in placed
                      if o.first <= b.last and b.first <= o.last)
        best, best_gap, cursor = None, None, 0
        for lo, hi in busy:
            gap = lo - cursor
            if gap >= size and (best_gap is None or gap < best_gap):
                best, best_gap = cursor, gap
            cursor = max(cursor, hi)
        offset = best if best is not None else cursor
        offsets[b.id] = offset
        placed.append((offset, size, b))
    arena = max((off + sz for off, sz, _ in placed), default=0)
    fits = None if capacity is None else arena <= capacity
    return Plan(offsets, arena, lower_bound(buffers, alignment), "greedy_by_size", fits)


def plan_graph(graph: Graph, alignment: int = 64, strategy: str = "best",
               preserve_all: bool = False, buffer_handles=()) -> GraphPlan:
    lifetimes = liveness(graph)
    external = tuple(sorted(buffer_handles))
    end = len(graph.nodes) - 1
    buffers = []
    for name, (first, last) in lifetimes.items():
        if name in external:
            continue
        if preserve_all:
            first, last = 0, end
        buffers.append(Buffer(name, graph.tensors[name].nbytes, first, last))
    plan = place(buffers, alignment, strategy)
    return GraphPlan(graph, plan.offsets, {b.id: b.size for b in buffers}, lifetimes,
                     plan.arena_size, plan.lower_bound, external, plan.strategy, alignment,
                     preserve_all)
