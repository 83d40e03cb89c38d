"""Memory planning: liveness of every tensor, then an offset for each in ONE arena.

Pure: integers in, a frozen plan out, no I/O. Node indices are inclusive: a buffer with
first=2, last=4 is live at nodes 2, 3 and 4, so a node's inputs and outputs never share bytes.

Strategies (every ordering deterministic; ties are written next to each order):

    naive              no sharing: buffers stacked in first-use order
    linear             bump allocation in first-use order: each buffer goes on top of the
                       buffers still live when it starts (space below frees only when the
                       buffers above it are gone, like a stack)
    greedy_by_size     TFLite ArenaPlanner: largest first, each into the smallest gap among
                       the placed buffers whose lifetimes overlap (the gap at 0 included),
                       else on top of them
    greedy_by_breadth  Pisarchyk & Lee 2020: nodes by live bytes, descending; within a node
                       its unplaced buffers by size; same best-fit placement
    best               a portfolio of orders with that placement, then a search over canonical
                       solutions (MiniMalloc, Moffitt 2024) until the arena reaches the lower
                       bound, fits the capacity, or the time budget is spent

Sizes are aligned up to the alignment before planning and offsets are multiples of it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from .errors import GraphError
from .graph import Graph

try:
    from ._ext import placement as _core
except ImportError:  # not built: best-fit runs in Python and `best` skips the search
    _core = None

STRATEGIES = ("naive", "linear", "greedy_by_size", "greedy_by_breadth", "best")
MAX_INT = 2**62  # sizes, node indices and alignments stay below this (int64 with headroom)

# The search builds per-buffer overlap lists; past this many overlapping pairs it would cost
# more memory and set-up time than it can win back, and `best` keeps the portfolio result.
MAX_SEARCH_PAIRS = 4_000_000
# The search recurses in C a few frames per placed buffer (about 1.5 MB of stack at this
# size, well inside the 8 MB a thread gets by default on Linux).
MAX_SEARCH_BUFFERS = 3000
# The search's budget is counted in work (buffers and sections scanned), not seconds, so the
# same input gives the same plan on any machine: time_limit_s buys this much work per second.
# The search does 0.4-1.1e9 a second on the 2-core development machine, so there the work
# budget ends the search well before the clock; the clock stays as a safety net for machines
# several times slower or heavily loaded (and only there can a plan vary between runs).
WORK_PER_SECOND = 300_000_000


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
    """(first, last) node index per non-weight tensor, inclusive, TFLite semantics: first is
    the writing node (node 0 for inputs and persistent tensors), last the last reading node;
    outputs and persistent tensors live to the last node; a scratch tensor lives at its node
    only. Weights are not planned and have no entry."""
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
                # max, not assignment: a persistent tensor read mid-graph still lives to the end
                last[name] = max(last[name], i)
    for t in graph.tensors.values():
        if t.kind == "output":
            last[t.name] = end
    return {name: (first[name], last[name]) for name in first}


def lower_bound(buffers, alignment: int = 64) -> int:
    """Max over nodes of the aligned bytes live at that node: no plan can be smaller."""
    _check_alignment(alignment)
    buffers = list(buffers)
    _check_buffers(buffers)
    return _peak_live([align_up(b.size, alignment) for b in buffers],
                      [b.first for b in buffers], [b.last + 1 for b in buffers])


def _peak_live(size, start, end) -> int:
    events: dict[int, int] = {}
    for s, a, e in zip(size, start, end):
        events[a] = events.get(a, 0) + s
        events[e] = events.get(e, 0) - s
    live = peak = 0
    for t in sorted(events):  # at equal times the end and the start net out: half-open
        live += events[t]
        peak = max(peak, live)
    return peak


def place(buffers, alignment: int = 64, strategy: str = "best", capacity=None,
          time_limit_s: float = 10.0) -> Plan:
    """Offsets for `buffers` (Buffer objects) in one arena; see the module doc for strategies.

    With a capacity (bytes), Plan.fits says whether the arena fits, and `best` stops searching
    as soon as a plan fits. `best` stops early too when it reaches the lower bound; otherwise
    it runs until its budget is spent: time_limit_s converted to a machine-independent work
    count (see WORK_PER_SECOND), so the same input gives the same plan, with time_limit_s
    itself as a hard stop in case the machine is much slower.
    """
    _check_alignment(alignment)
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if capacity is not None and (not _is_int(capacity) or capacity < 0):
        raise ValueError(f"capacity {capacity!r} must be a non-negative int (bytes) or None")
    if (not isinstance(time_limit_s, (int, float)) or isinstance(time_limit_s, bool)
            or not 0 <= time_limit_s < math.inf):
        raise ValueError(f"time_limit_s {time_limit_s!r} must be a finite number >= 0")
    buffers = list(buffers)
    _check_buffers(buffers)
    deadline = time.monotonic() + time_limit_s
    p = _Problem(buffers, alignment)
    if strategy == "best":
        offsets = _best(p, None if capacity is None else capacity // p.unit, deadline,
                        int(time_limit_s * WORK_PER_SECOND))
    else:
        offsets = _STRATEGY_ORDER[strategy](p)
    arena = p.arena(offsets) * p.unit
    return Plan({b.id: int(o) * p.unit for b, o in zip(buffers, offsets)}, arena,
                p.lower_bound * p.unit, strategy,
                None if capacity is None else arena <= capacity)


def plan_graph(graph: Graph, alignment: int = 64, strategy: str = "best",
               preserve_all: bool = False, buffer_handles=(),
               time_limit_s: float = 0.5) -> GraphPlan:
    """Plan every non-weight tensor of `graph` except the buffer-handle ones (memory the caller
    owns, bound at run time). preserve_all keeps every planned tensor for the whole graph, so
    nothing shares bytes and every intermediate stays readable after a run."""
    lifetimes = liveness(graph)
    external = tuple(sorted(set(buffer_handles)))
    for name in external:
        if name not in graph.tensors:
            raise GraphError(f"buffer handle {name!r} is not a tensor of graph {graph.name!r}")
        if name not in lifetimes:
            raise GraphError(f"buffer handle {name!r} is a {graph.tensors[name].kind} tensor "
                             "no node writes or reads; only planned tensors can be handles")
    end = len(graph.nodes) - 1
    buffers = []
    for name in sorted(lifetimes):  # sorted: the plan does not depend on insertion order
        if name in external:
            continue
        first, last = (0, end) if preserve_all else lifetimes[name]
        buffers.append(Buffer(name, graph.tensors[name].nbytes, first, last))
    plan = place(buffers, alignment, strategy, time_limit_s=time_limit_s)
    return GraphPlan(graph, plan.offsets, {b.id: b.size for b in buffers}, lifetimes,
                     plan.arena_size, plan.lower_bound, external, plan.strategy, alignment,
                     preserve_all)


# -- validation -------------------------------------------------------------------------------

def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_alignment(alignment) -> None:
    if not _is_int(alignment) or not 1 <= alignment < MAX_INT or alignment & (alignment - 1):
        raise ValueError(f"alignment {alignment!r} must be a power of two >= 1 (e.g. 64)")


def _check_buffers(buffers) -> None:
    seen = set()
    total = 0
    for b in buffers:
        if not isinstance(b, Buffer):
            raise ValueError(f"expected Buffer(id, size, first, last), got {b!r}")
        for field in ("size", "first", "last"):
            if not _is_int(getattr(b, field)):
                raise ValueError(f"buffer {b.id!r}: {field} {getattr(b, field)!r} is not an int")
        if b.size < 0:
            raise ValueError(f"buffer {b.id!r}: size {b.size} is negative")
        if max(b.size, b.last) >= MAX_INT:  # the compiled search works in int64
            raise ValueError(f"buffer {b.id!r}: size {b.size} / last {b.last} is too large "
                             f"(limit {MAX_INT - 1})")
        if b.first < 0:
            raise ValueError(f"buffer {b.id!r}: first {b.first} is negative")
        if b.last < b.first:
            raise ValueError(f"buffer {b.id!r}: last {b.last} < first {b.first}; lifetimes "
                             "are inclusive node ranges")
        if b.id in seen:
            raise ValueError(f"buffer id {b.id!r} appears twice; ids must be unique")
        seen.add(b.id)
        total += int(b.size)
    if total >= MAX_INT:
        raise ValueError(f"the buffers add up to {total} bytes, more than the planner's limit "
                         f"of {MAX_INT - 1}")


# -- the problem in units ---------------------------------------------------------------------

class _Problem:
    """Buffers as arrays in units, half-open lifetimes [start, end).

    The unit is the alignment times the gcd of the aligned sizes: every offset any strategy
    produces is a sum of sizes, so it is a multiple of the unit and nothing is lost; the
    bisection over arena sizes in `best` then takes fewer, more meaningful steps."""

    def __init__(self, buffers, alignment: int):
        self.n = len(buffers)
        aligned = [align_up(b.size, alignment) // alignment for b in buffers]
        self.unit = alignment * (math.gcd(*aligned) or 1)
        self.size = np.array(aligned, dtype=np.int64) * alignment // self.unit
        self.start = np.array([b.first for b in buffers], dtype=np.int64)
        self.end = np.array([b.last + 1 for b in buffers], dtype=np.int64)
        self.lower_bound = _peak_live(self.size.tolist(), self.start.tolist(),
                                      self.end.tolist())
        self.id_rank = _id_ranks(buffers)

    def arena(self, offsets) -> int:
        if self.n == 0:
            return 0
        return int((np.asarray(offsets, dtype=np.int64) + self.size).max())


def _id_ranks(buffers) -> np.ndarray:
    """Rank of each buffer's id in sorted order: the last tie-break of every ordering. Ids that
    do not sort together (mixed types) fall back to their position in the input."""
    idx = list(range(len(buffers)))
    try:
        idx.sort(key=lambda i: buffers[i].id)
    except TypeError:
        pass
    rank = np.empty(len(buffers), dtype=np.int64)
    rank[idx] = np.arange(len(buffers))
    return rank


# -- orders and placement ---------------------------------------------------------------------

def _by(*keys) -> np.ndarray:
    """Indices sorted by the given key arrays, first key most significant (np.lexsort wants the
    least significant first)."""
    return np.lexsort(tuple(reversed(keys))).astype(np.int64)


def _size_order(p: _Problem) -> np.ndarray:
    # TFLite CompareBySize: size descending, then first use, then id.
    return _by(-p.size, p.start, p.id_rank)


def _first_use_order(p: _Problem) -> np.ndarray:
    # First use, then the longer-lived first, then id.
    return _by(p.start, -p.end, p.id_rank)


def _breadth_order(p: _Problem) -> np.ndarray:
    """Nodes by breadth (live bytes) descending, ties by node index; within a node its buffers
    not yet taken by size descending, then first use, then id. Only nodes where some buffer
    starts are visited: any other node's live set is a subset of an earlier node's."""
    times = np.unique(p.start)
    live = [[] for _ in times]
    pos = {int(t): i for i, t in enumerate(times)}
    for b in range(p.n):  # buffer b is live at every start time in [start, end)
        lo = pos[int(p.start[b])]
        hi = int(np.searchsorted(times, p.end[b]))
        for i in range(lo, hi):
            live[i].append(b)
    breadth = np.array([int(p.size[ids].sum()) if ids else 0 for ids in live], dtype=np.int64)
    taken = np.zeros(p.n, dtype=bool)
    order = []
    for i in _by(-breadth, times):
        ids = [b for b in live[i] if not taken[b]]
        ids.sort(key=lambda b: (-p.size[b], p.start[b], p.id_rank[b]))
        taken[ids] = True
        order.extend(ids)
    return np.array(order, dtype=np.int64)


def _best_fit(p: _Problem, order, on_top: bool = False) -> np.ndarray:
    if _core is not None:
        return _core.best_fit(p.size, p.start, p.end, np.ascontiguousarray(order), on_top)
    return _best_fit_py(p.size, p.start, p.end, order, on_top)


def _best_fit_py(size, start, end, order, on_top=False) -> np.ndarray:
    """The same placement as the compiled core, in Python: the oracle its tests compare to."""
    offsets = np.zeros(len(size), dtype=np.int64)
    placed: list[tuple[int, int]] = []  # (offset, buffer), kept sorted by offset then order
    for b in map(int, order):
        cursor, best, best_gap = 0, -1, 0
        for off, o in placed:
            if start[o] >= end[b] or start[b] >= end[o]:
                continue  # lifetimes do not overlap: free to share bytes
            gap = off - cursor
            if not on_top and gap >= size[b] and (best < 0 or gap < best_gap):
                best, best_gap = cursor, gap
            cursor = max(cursor, off + int(size[o]))
        if best < 0:
            best = cursor
        offsets[b] = best
        k = len(placed)
        while k > 0 and placed[k - 1][0] > best:
            k -= 1
        placed.insert(k, (best, b))
    return offsets


def _naive(p: _Problem) -> np.ndarray:
    order = _first_use_order(p)
    offsets = np.zeros(p.n, dtype=np.int64)
    offsets[order] = np.cumsum(p.size[order]) - p.size[order]
    return offsets


_STRATEGY_ORDER = {
    "naive": _naive,
    "linear": lambda p: _best_fit(p, _first_use_order(p), on_top=True),
    "greedy_by_size": lambda p: _best_fit(p, _size_order(p)),
    "greedy_by_breadth": lambda p: _best_fit(p, _breadth_order(p)),
}


# -- best: portfolio, then search ---------------------------------------------------------------

def _by_area(p: _Problem) -> np.ndarray:
    return _by(-p.size * (p.end - p.start), -p.size, p.start, p.id_rank)


def _by_width(p: _Problem) -> np.ndarray:
    return _by(-(p.end - p.start), -p.size, p.start, p.id_rank)


def _by_start(p: _Problem) -> np.ndarray:
    return _by(p.start, -p.size, p.id_rank)


# Orders for best-fit placement: the TFLite one first (so `best` is never worse), then orders
# that catch shapes it misses: area (bytes x time), long-lived first (residual streams), time
# order, and last the busiest node first (the costliest to compute). Stops at the first plan
# that is good enough.
_PORTFOLIO = (_size_order, _by_area, _by_width, _by_start, _breadth_order)


def _best(p: _Problem, capacity_u, deadline: float, work: int) -> np.ndarray:
    """Smallest arena found: the best portfolio plan (ties: earlier in the portfolio, so never
    worse than greedy_by_size), improved by the canonical search while time remains."""
    best, best_arena = None, None
    for make_order in _PORTFOLIO:
        offsets = _best_fit(p, make_order(p))
        arena = p.arena(offsets)
        if best is None or arena < best_arena:
            best, best_arena = offsets, arena
        if _done(best_arena, p.lower_bound, capacity_u):
            return best
    if (_core is None
            or p.n > MAX_SEARCH_BUFFERS or _pairs(p) > MAX_SEARCH_PAIRS):
        return best
    active = p.size > 0  # zero-size buffers take no bytes: offset 0, left out of the search
    idx = np.flatnonzero(active)
    search = _core.CanonicalSearch(p.size[idx], p.start[idx], p.end[idx])
    if capacity_u is not None:
        found, _ = _decide(search, capacity_u, deadline, work)
        return _expand(p, idx, found) if isinstance(found, np.ndarray) else best
    # No capacity: shrink the arena. Try the lower bound first with half the budget (it is
    # often reachable, and then nothing else is needed), then bisect between what is proven
    # infeasible or given up on and the best arena found, each step an equal share of the rest.
    lo, hi = p.lower_bound, best_arena - 1
    target = lo
    steps = 2
    while lo <= hi and work > 0 and time.monotonic() < deadline:
        found, used = _decide(search, target, deadline, work // steps)
        work -= used
        if isinstance(found, np.ndarray):
            best = _expand(p, idx, found)
            best_arena = p.arena(best)
            hi = best_arena - 1
        else:  # proven infeasible, or not found in this slice: look higher
            lo = target + 1
        target = (lo + hi) // 2
        steps = max(1, (hi - lo + 1).bit_length())
    return best


def _done(arena: int, lower: int, capacity_u) -> bool:
    return arena <= lower or (capacity_u is not None and (arena <= capacity_u
                                                           or capacity_u < lower))


def _pairs(p: _Problem) -> int:
    """Number of (ordered) overlapping pairs, from sorted starts and ends: the search's size."""
    starts, ends = np.sort(p.start), np.sort(p.end)
    # buffers overlapping b: started before b ends, minus those ended by the time b starts
    overlapping = np.searchsorted(starts, p.end, "left") - np.searchsorted(ends, p.start,
                                                                             "right")
    return int(overlapping.sum()) - p.n


def _decide(search, capacity_u: int, deadline: float, work: int):
    """(result, work used). The result is offsets (search indices) within capacity_u,
    'infeasible' when the search proves there are none, or None when the work budget or the
    deadline ran out first. Round robin over MiniMalloc's preorders (which buffer to try first
    among equal min offsets) with a node limit doubling each round: one preorder often
    finishes fast where another wanders."""
    node_limit, used = search.n_buffers, 0
    while used < work:
        node_limit *= 2
        for heuristic in _core.HEURISTICS:
            status, offsets = search.run(capacity_u, heuristic, deadline, node_limit,
                                         work - used)
            used += search.work
            if status == "found":
                return offsets, used
            if status == "infeasible":
                return "infeasible", used
            if status in ("timeout", "budget"):
                return None, used
    return None, used


def _expand(p: _Problem, idx, found) -> np.ndarray:
    offsets = np.zeros(p.n, dtype=np.int64)
    offsets[idx] = found
    assert _disjoint(p, offsets), "canonical search returned overlapping buffers"
    return offsets


def _disjoint(p: _Problem, offsets) -> bool:
    """No two buffers live at the same node share a byte (checked per buffer, vectorized)."""
    top = offsets + p.size
    for b in range(p.n):
        clash = ((p.start < p.end[b]) & (p.start[b] < p.end) & (offsets < top[b])
                 & (offsets[b] < top) & (p.size > 0))
        clash[b] = False
        if p.size[b] > 0 and clash.any():
            return False
    return True
