"""The arena: one 64-byte-aligned buffer holding every planned tensor, plus its checking tools.

    plan = plan_graph(graph)
    simulate(plan)                 # replay alloc/free node by node; raises on any overlap
    arena = Arena(plan)            # one allocation, a cached ndarray view per tensor
    arena.view("x")[:] = ...       # or arena.bind("x", user_array) for a buffer-handle tensor
    print(report(plan))            # who shares bytes with whom, the big unshared tensors

Sanitizer: Arena(plan, sanitize=True) (or env MAGNITUDE_SANITIZE=1) poisons a tensor's bytes
right after its last reader runs (the executor calls arena.after_node(i)), so a kernel that
reads a dead tensor, or a plan that lets two live tensors share bytes, turns results into NaN
instead of silently wrong numbers.
"""
from __future__ import annotations

import os
from bisect import bisect_left
from dataclasses import dataclass

import numpy as np

from .errors import PlanError
from .graph import BLOCK_DTYPES, Graph, row_bytes
from .planner import GraphPlan, align_up

BASE_ALIGNMENT = 64  # cache line; also what AVX-512 loads like
NUMPY_DTYPES = {"f32": np.float32, "f16": np.float16, "i32": np.int32, "i8": np.int8}
FLOAT_DTYPES = frozenset({"f32", "f16"})
POISON_BYTE = 0xA5  # for integer and block tensors; float tensors get NaN
# Kinds whose bytes are still wanted after their last reader inside the graph.
KEEP_KINDS = frozenset({"output", "persistent"})


def view_shape(graph: Graph, name: str) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and numpy dtype of a tensor's view: block types are raw uint8 rows."""
    t = graph.tensors[name]
    if t.dtype in BLOCK_DTYPES:
        shape = t.shape or (32,)  # a scalar of a block type is one block
        return (*shape[:-1], row_bytes(shape[-1], t.dtype)), np.dtype(np.uint8)
    return t.shape, np.dtype(NUMPY_DTYPES[t.dtype])


def planned_lifetimes(plan: GraphPlan) -> dict[str, tuple[int, int]]:
    """The node range each planned tensor holds its bytes for, as the plan claims it.
    preserve_all keeps every tensor for the whole graph."""
    if plan.preserve_all:
        end = len(plan.graph.nodes) - 1
        return {name: (0, end) for name in plan.offsets}
    missing = sorted(set(plan.offsets) - set(plan.lifetimes))
    if missing:
        raise PlanError(f"planned tensor {missing[0]!r} has an offset but no lifetime in the "
                        "plan; build plans with plan_graph()")
    return {name: plan.lifetimes[name] for name in plan.offsets}


def _check_bounds(plan: GraphPlan) -> None:
    """Every planned tensor: known, not a weight, aligned, inside the arena."""
    graph = plan.graph
    for name in plan.external:
        t = graph.tensors.get(name)
        if t is None or t.kind == "weight":
            what = "is not in" if t is None else "is a weight of"
            raise PlanError(f"buffer handle {name!r} {what} graph {graph.name!r}; only "
                            "non-weight tensors of the graph can be bound at run time")
    for name in sorted(plan.offsets):
        offset = plan.offsets[name]
        t = graph.tensors.get(name)
        if t is None:
            raise PlanError(f"plan places tensor {name!r}, which graph {graph.name!r} "
                            "does not have")
        if t.kind == "weight":
            raise PlanError(f"plan places weight {name!r} in the arena; weights stay in the "
                            "model file")
        if name in plan.external:
            raise PlanError(f"tensor {name!r} is both a buffer handle and planned at offset "
                            f"{offset}; it must be one or the other")
        if offset < 0 or offset % plan.alignment:
            raise PlanError(f"tensor {name!r} has offset {offset}, not a non-negative multiple "
                            f"of the plan alignment {plan.alignment}")
        size = plan.sizes.get(name)
        if size != t.nbytes:
            raise PlanError(f"plan size of tensor {name!r} is {size} bytes but the tensor "
                            f"{t.shape} {t.dtype} needs {t.nbytes}")
        if offset + size > plan.arena_size:
            raise PlanError(f"tensor {name!r} [{offset}, {offset + size}) runs past the arena "
                            f"end ({plan.arena_size} bytes)")


# --------------------------------------------------------------------------------------------
# Simulation


def graph_lifetimes(graph: Graph) -> dict[str, tuple[int, int]]:
    """Inclusive (first, last) node range every non-weight tensor must keep its bytes for,
    derived here from the graph's reads and writes and on purpose not shared with the planner's
    liveness(): a checker that reuses the code it checks cannot catch its bugs."""
    graph.validate()
    end = len(graph.nodes) - 1
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, node in enumerate(graph.nodes):
        for name in (*node.inputs, *node.outputs):
            if graph.tensors[name].kind != "weight":
                first.setdefault(name, i)
                last[name] = i
    for t in graph.tensors.values():
        if t.kind in ("input", "persistent"):  # written by the caller before node 0
            first[t.name] = 0
        if t.kind in ("output", "persistent"):  # read by the caller after the last node
            last[t.name] = end
        if t.kind in ("input", "persistent") and t.name not in last:
            last[t.name] = 0  # never read, still a buffer the caller fills
    return {name: (first[name], last[name]) for name in sorted(first)}


@dataclass(frozen=True)
class Simulation:
    live_bytes: tuple[int, ...]  # per node: aligned bytes of the tensors live at that node
    peak_live: int  # max of live_bytes; equals the plan's lower bound for a sound plan
    peak_node: int  # first node where peak_live is reached
    high_water: int  # highest byte any tensor touches (offset + unaligned size)


def simulate(plan: GraphPlan) -> Simulation:
    """Replay the plan like TFLite's SimpleMemoryArena: at node i allocate the tensors born
    there, check each against the live ones, then free those whose last use is node i.

    Lifetimes come from the graph itself (not from the plan), so a plan built from a wrong
    liveness is caught here. Raises PlanError naming both tensors and the node on an overlap,
    and naming the tensor when it runs past the arena end, has no offset or is misaligned."""
    if not isinstance(plan, GraphPlan):
        raise TypeError(f"simulate() wants a GraphPlan (from plan_graph), got "
                        f"{type(plan).__name__}")
    graph = plan.graph
    _check_bounds(plan)
    truth = graph_lifetimes(graph)
    end = len(graph.nodes) - 1
    external = set(plan.external)
    born: dict[int, list[str]] = {}
    dies: dict[int, list[str]] = {}
    for name in sorted(truth):
        if name in external:
            continue
        if name not in plan.offsets:
            raise PlanError(f"tensor {name!r} ({graph.tensors[name].kind}) is used by the graph "
                            "but the plan gives it no offset and it is not a buffer handle")
        first, last = (0, end) if plan.preserve_all else truth[name]
        born.setdefault(first, []).append(name)
        dies.setdefault(last, []).append(name)
    # Live tensors never overlap each other, so sorted by start they are also sorted by end and
    # a newcomer can only collide with its two neighbours in that order.
    starts: list[int] = []
    live: list[str] = []
    live_bytes = []
    live_now = high_water = 0
    for i in range(end + 1):
        for name in born.get(i, ()):
            lo = plan.offsets[name]
            hi = lo + plan.sizes[name]
            k = bisect_left(starts, lo)
            for j in (k - 1, k):
                if 0 <= j < len(live):
                    other = live[j]
                    o_lo = starts[j]
                    o_hi = o_lo + plan.sizes[other]
                    if o_lo < hi and lo < o_hi:
                        raise PlanError(_overlap_message(plan, truth, i, name, other))
            starts.insert(k, lo)
            live.insert(k, name)
            live_now += align_up(plan.sizes[name], plan.alignment)
            high_water = max(high_water, hi)
        live_bytes.append(live_now)
        for name in dies.get(i, ()):
            k = live.index(name)
            del starts[k], live[k]
            live_now -= align_up(plan.sizes[name], plan.alignment)
    _check_claimed_lifetimes(plan, truth)
    peak = max(live_bytes)
    return Simulation(tuple(live_bytes), peak, live_bytes.index(peak), high_water)


def _overlap_message(plan: GraphPlan, truth, i: int, a: str, b: str) -> str:
    node = plan.graph.nodes[i]
    a_lo, b_lo = plan.offsets[a], plan.offsets[b]
    a_hi, b_hi = a_lo + plan.sizes[a], b_lo + plan.sizes[b]
    return (f"at node {i} ({node}) tensors {a!r} [{a_lo}, {a_hi}) and {b!r} [{b_lo}, {b_hi}) "
            f"are both live and share bytes [{max(a_lo, b_lo)}, {min(a_hi, b_hi)}); "
            f"{a!r} lives nodes {truth[a][0]}..{truth[a][1]}, "
            f"{b!r} lives nodes {truth[b][0]}..{truth[b][1]}")


def _check_claimed_lifetimes(plan: GraphPlan, truth) -> None:
    """The sanitizer poisons by the plan's lifetimes: they must cover the real ones."""
    for name in sorted(plan.offsets):
        claimed = plan.lifetimes.get(name)
        first, last = truth[name]
        if claimed is None or claimed[0] > first or claimed[1] < last:
            raise PlanError(f"plan lifetime of tensor {name!r} is {claimed} but the graph "
                            f"uses it at nodes {first}..{last}")


# --------------------------------------------------------------------------------------------
# Arena


def aligned_zeros(shape, dtype) -> np.ndarray:
    """Zeroed array whose first byte is on a cache line (over-allocate and slice). Its pages
    stay untouched, so not resident, until written: a KV cache costs memory only for the
    positions in use."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.zeros(nbytes + BASE_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % BASE_ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def sanitize_default() -> bool:
    return os.environ.get("MAGNITUDE_SANITIZE", "") == "1"


class Arena:
    """One uint8 buffer, base 64-byte aligned, holding every planned tensor of a GraphPlan.
    It starts zeroed; with the sanitizer on, everything but persistent tensors starts as NaN.

    Allocated once, here; view(name) and address(name) are what the executor runs on. Bounds and
    alignment are checked here; overlaps are simulate()'s job (the sanitizer test needs an arena
    over a deliberately broken plan)."""

    def __init__(self, plan: GraphPlan, sanitize: bool | None = None):
        if not isinstance(plan, GraphPlan):
            raise TypeError(f"Arena() wants a GraphPlan (from plan_graph), got "
                            f"{type(plan).__name__}")
        if plan.alignment % BASE_ALIGNMENT and BASE_ALIGNMENT % plan.alignment:
            raise PlanError(f"plan alignment {plan.alignment} and the arena base alignment "
                            f"{BASE_ALIGNMENT} do not divide one another")
        _check_bounds(plan)
        self.plan = plan
        self.sanitize = sanitize_default() if sanitize is None else bool(sanitize)
        self.nbytes = plan.arena_size
        self.buffer = aligned_zeros((self.nbytes,), np.uint8)  # [arena_size] uint8
        self.base_address = self.buffer.ctypes.data
        self._views: dict[str, np.ndarray] = {}
        self._bound: dict[str, np.ndarray] = {}
        self._dies = self._dies_lists() if self.sanitize else None
        if self.sanitize:
            # 0xFF bytes are NaN as float32 and as float16: catches reads of never-written bytes.
            # Persistent tensors (KV caches) keep the zeros a normal arena starts with: state the
            # caller may rely on, and bytes nothing else ever shares.
            self.buffer.fill(0xFF)
            for name in sorted(self.plan.offsets):
                if self.plan.graph.tensors[name].kind == "persistent":
                    self.view(name).view(np.uint8).fill(0)

    def _dies_lists(self) -> list[tuple[str, ...]]:
        """Per node, the planned tensors whose bytes are dead once that node has run."""
        dies: list[list[str]] = [[] for _ in self.plan.graph.nodes]
        if self.plan.preserve_all:  # the point of preserve_all is that nothing dies
            return [()] * len(dies)
        kinds = self.plan.graph.tensors
        for name, (_, last) in sorted(planned_lifetimes(self.plan).items()):
            if kinds[name].kind not in KEEP_KINDS:
                dies[last].append(name)
        return [tuple(names) for names in dies]

    def view(self, name: str) -> np.ndarray:
        """The tensor as an ndarray of its shape and dtype (uint8 rows for block types)."""
        v = self._views.get(name)
        if v is not None:
            return v
        if name in self._bound:
            return self._bound[name]
        self._must_be_planned(name)
        shape, dtype = view_shape(self.plan.graph, name)
        v = np.ndarray(shape, dtype, buffer=self.buffer, offset=self.plan.offsets[name])
        self._views[name] = v
        return v

    def _must_be_planned(self, name: str) -> None:
        if name in self.plan.offsets:
            return
        t = self.plan.graph.tensors.get(name)
        if t is None:
            raise PlanError(f"no tensor {name!r} in graph {self.plan.graph.name!r}")
        if name in self.plan.external:
            raise PlanError(f"buffer-handle tensor {name!r} is not bound yet; call "
                            f"arena.bind({name!r}, array) first")
        if t.kind == "weight":
            raise PlanError(f"{name!r} is a weight: it lives in the model file, not the arena")
        raise PlanError(f"tensor {name!r} is not in the plan (no offset); re-plan the graph")

    def bind(self, name: str, array: np.ndarray) -> None:
        """Attach user memory to a buffer-handle tensor: no copy, the kernels use it in place."""
        graph = self.plan.graph
        if name not in self.plan.external:
            if name in self.plan.offsets:
                raise PlanError(f"tensor {name!r} lives in the arena at offset "
                                f"{self.plan.offsets[name]}, it is not a buffer handle; plan "
                                f"with plan_graph(..., buffer_handles=[{name!r}]) to bind it")
            raise PlanError(f"tensor {name!r} is not a buffer handle of graph {graph.name!r}; "
                            f"buffer handles: {list(self.plan.external)}")
        if not isinstance(array, np.ndarray):
            raise ValueError(f"bind({name!r}): wants a numpy array, got {type(array).__name__}")
        shape, dtype = view_shape(graph, name)
        t = graph.tensors[name]
        if array.dtype != dtype:
            raise ValueError(f"bind({name!r}): array dtype is {array.dtype}, the {t.dtype} "
                             f"tensor needs {dtype}")
        if array.nbytes != t.nbytes:
            raise ValueError(f"bind({name!r}): array has {array.nbytes} bytes {array.shape}, "
                             f"the tensor {t.shape} {t.dtype} needs {t.nbytes}")
        if not array.flags.c_contiguous:
            raise ValueError(f"bind({name!r}): array is not C-contiguous; pass "
                             "np.ascontiguousarray(array) (that copies) or a contiguous buffer")
        if array.ctypes.data % BASE_ALIGNMENT:
            raise ValueError(f"bind({name!r}): array address {array.ctypes.data:#x} is not "
                             f"{BASE_ALIGNMENT}-byte aligned (off by "
                             f"{array.ctypes.data % BASE_ALIGNMENT}); allocate with an aligned "
                             "allocator or over-allocate and slice")
        if not array.flags.writeable and t.kind != "input":
            raise ValueError(f"bind({name!r}): array is read-only but the graph writes "
                             f"{t.kind} tensor {name!r}")
        self._bound[name] = array.reshape(shape)  # C-contiguous, so a view, never a copy

    def address(self, name: str) -> int:
        """Raw address of the tensor's first byte (for the executor's op table)."""
        if name in self._bound:
            return self._bound[name].ctypes.data
        self._must_be_planned(name)
        return self.base_address + self.plan.offsets[name]

    def after_node(self, i: int) -> None:
        """Executor hook, called after node i ran: poisons tensors that died at node i.
        Costs nothing when the sanitizer is off."""
        if self._dies is None:
            return
        if not 0 <= i < len(self._dies):
            raise ValueError(f"after_node({i}): node index out of range 0..{len(self._dies) - 1}")
        for name in self._dies[i]:
            v = self.view(name)
            if self.plan.graph.tensors[name].dtype in FLOAT_DTYPES:
                v.fill(np.nan)
            else:
                v.view(np.uint8).fill(POISON_BYTE)

    def dies_after(self, i: int) -> tuple[str, ...]:
        """Tensors the sanitizer poisons after node i (empty when it is off)."""
        return self._dies[i] if self._dies is not None else ()

    def __repr__(self) -> str:
        return (f"Arena({self.plan.graph.name!r}, {self.nbytes} bytes, "
                f"{len(self.plan.offsets)} tensors, base {self.base_address:#x}"
                f"{', sanitize' if self.sanitize else ''})")


# --------------------------------------------------------------------------------------------
# Report


@dataclass(frozen=True)
class TensorRow:
    name: str
    kind: str
    layer: int | None
    op: str  # op of the node that first writes it ("input" for caller-written tensors)
    offset: int
    size: int  # unaligned bytes
    lifetime: tuple[int, int]  # inclusive node range the plan holds its bytes for
    reuse: int  # other tensors placed on some of its bytes at other times


@dataclass(frozen=True)
class Report:
    graph: str
    strategy: str
    rows: tuple[TensorRow, ...]  # by offset, then first node, then name
    arena_size: int
    lower_bound: int
    naive_total: int  # sum of aligned sizes: the arena with no reuse at all
    external: tuple[str, ...]
    large_unshared: tuple[str, ...]  # big tensors that share bytes with nobody, largest first
    alignment: int = 64

    @property
    def ratio(self) -> float:
        """arena size / lower bound (1.0 is optimal)."""
        return self.arena_size / self.lower_bound if self.lower_bound else 1.0

    def summary(self) -> str:
        saved = 1 - self.arena_size / self.naive_total if self.naive_total else 0.0
        lines = [f"graph {self.graph!r}: {len(self.rows)} tensors in the arena, "
                 f"{len(self.external)} buffer handles, strategy {self.strategy}",
                 f"arena {_fmt_bytes(self.arena_size)}, lower bound "
                 f"{_fmt_bytes(self.lower_bound)} (ratio {self.ratio:.3f}), no-reuse total "
                 f"{_fmt_bytes(self.naive_total)} (reuse saves {saved:.1%})"]
        unshared = self.unshared_bytes()
        if unshared:
            total = sum(n for n, _ in unshared.values())
            parts = ", ".join(f"{kind} {_fmt_bytes(n)} ({count})"
                              for kind, (n, count) in unshared.items())
            share = total / self.arena_size if self.arena_size else 0.0
            lines.append(f"bytes nobody else uses: {_fmt_bytes(total)} ({share:.0%} of the "
                         f"arena): {parts}")
        if self.large_unshared:
            shown = ", ".join(self.large_unshared[:5])
            more = len(self.large_unshared) - 5
            lines.append(f"large tensors sharing with nobody: {shown}"
                         + (f" (+{more} more)" if more > 0 else ""))
        return "\n".join(lines)

    def unshared_bytes(self) -> dict[str, tuple[int, int]]:
        """Kind -> (aligned bytes, tensor count) of tensors whose bytes no other tensor reuses,
        largest first: with a long KV cache the persistent share dominates."""
        out: dict[str, list[int]] = {}
        for r in self.rows:
            if r.reuse == 0:
                acc = out.setdefault(r.kind, [0, 0])
                acc[0] += align_up(r.size, self.alignment)
                acc[1] += 1
        return {k: (v[0], v[1]) for k, v in sorted(out.items(), key=lambda kv: (-kv[1][0],
                                                                                  kv[0]))}

    def table(self, limit: int | None = 40, sort: str = "offset") -> str:
        """Fixed-width table; sort by 'offset' (arena order) or 'size' (largest first)."""
        if sort not in ("offset", "size"):
            raise ValueError(f"table(sort={sort!r}): sort by 'offset' or 'size'")
        if limit is not None and limit < 0:
            raise ValueError(f"table(limit={limit}): limit must be >= 0 or None")
        rows = list(self.rows)
        if sort == "size":
            rows.sort(key=lambda r: (-r.size, r.offset, r.name))
        shown = rows if limit is None else rows[:limit]
        flagged = set(self.large_unshared)
        width = max([len(r.name) for r in shown] + [6])
        head = (f"{'tensor':<{width}}  {'kind':<12} {'layer':>5} {'op':<12} {'offset':>12} "
                f"{'size':>12} {'nodes':>11} {'reuse':>5}")
        lines = [head, "-" * len(head)]
        for r in shown:
            layer = "" if r.layer is None else str(r.layer)
            nodes = f"{r.lifetime[0]}..{r.lifetime[1]}"
            flag = "  <- large, unshared" if r.name in flagged else ""
            lines.append(f"{r.name:<{width}}  {r.kind:<12} {layer:>5} {r.op[:12]:<12} "
                         f"{r.offset:>12,} {r.size:>12,} {nodes:>11} {r.reuse:>5}{flag}")
        if len(shown) < len(rows):
            lines.append(f"... {len(rows) - len(shown)} more (table(limit=None) shows all)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary() + "\n\n" + self.table()


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def writer_ops(graph: Graph) -> dict[str, str]:
    """Op of the first node writing each tensor; caller-written tensors are 'input'."""
    ops = {t.name: "input" for t in graph.tensors.values() if t.kind == "input"}
    for node in graph.nodes:
        for name in node.outputs:
            ops.setdefault(name, node.op)
    return ops


def reuse_counts(offsets, sizes, firsts, lasts) -> np.ndarray:
    """For each tensor, how many others overlap it in bytes while disjoint in time. [n] int64

    Vectorised by row blocks so ~10k tensors stay within a few hundred MB of temporaries."""
    lo = np.asarray(offsets, dtype=np.int64)  # [n]
    hi = lo + np.asarray(sizes, dtype=np.int64)  # [n]
    first = np.asarray(firsts, dtype=np.int64)  # [n]
    last = np.asarray(lasts, dtype=np.int64)  # [n]
    counts = np.zeros(len(lo), dtype=np.int64)  # [n]
    step = 1024
    for s in range(0, len(lo), step):
        e = min(s + step, len(lo))
        space = (lo[s:e, None] < hi[None, :]) & (lo[None, :] < hi[s:e, None])  # [b, n]
        time = (first[s:e, None] <= last[None, :]) & (first[None, :] <= last[s:e, None])
        counts[s:e] = (space & ~time).sum(axis=1)  # a tensor always overlaps itself in time
    return counts


def report(plan: GraphPlan, large_fraction: float = 0.05) -> Report:
    """Per-tensor placement and reuse. A tensor is 'large' when it takes at least
    large_fraction of the arena; large ones with reuse 0 are listed first places to look."""
    if not isinstance(plan, GraphPlan):
        raise TypeError(f"report() wants a GraphPlan (from plan_graph), got "
                        f"{type(plan).__name__}")
    if not 0 <= large_fraction <= 1:
        raise ValueError(f"report(large_fraction={large_fraction}): must be within [0, 1]")
    graph = plan.graph
    lifetimes = planned_lifetimes(plan)
    names = sorted(plan.offsets, key=lambda n: (plan.offsets[n], lifetimes[n][0], n))
    reuse = reuse_counts([plan.offsets[n] for n in names], [plan.sizes[n] for n in names],
                         [lifetimes[n][0] for n in names], [lifetimes[n][1] for n in names])
    ops = writer_ops(graph)
    rows = tuple(TensorRow(n, graph.tensors[n].kind, graph.tensors[n].layer,
                           ops.get(n, "?"), plan.offsets[n], plan.sizes[n], lifetimes[n],
                           int(k)) for n, k in zip(names, reuse))
    threshold = large_fraction * plan.arena_size
    large = sorted((r for r in rows if r.reuse == 0 and r.size >= threshold),
                   key=lambda r: (-r.size, r.name))
    naive = sum(align_up(r.size, plan.alignment) for r in rows)
    return Report(graph.name, plan.strategy, rows, plan.arena_size, plan.lower_bound, naive,
                  tuple(plan.external), tuple(r.name for r in large), plan.alignment)
