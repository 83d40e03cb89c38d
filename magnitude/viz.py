"""Pictures of a memory plan: where every tensor sits in the arena, and how full it is over time.

    plot_arena(plan, "arena.png")             # x = node, y = offset, one box per tensor
    plot_memory_timeline(plan, "live.png")    # live bytes per node vs arena size and lower bound

matplotlib is imported inside the functions (it costs ~0.3 s) and drawn through a bare Figure on
the Agg canvas, so these never touch pyplot's global state or the user's chosen backend. Neither
function checks the plan for overlaps: a broken plan is exactly what one wants to look at (run
arena.simulate() for the verdict).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .arena import planned_lifetimes, report
from .planner import GraphPlan, align_up

FORMATS = (".png", ".svg", ".pdf")
MAX_LABELS = 14
INPUT_OP = "input"  # what arena.writer_ops() calls tensors the caller writes
INPUT_COLOR = "#555555"
# Categorical colours for writer ops; more ops than this share the last colour ("other").
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1",
           "#ff9da7", "#9c755f", "#2f4b7c", "#d37295", "#a0cbe8", "#8cd17d", "#bab0ac")


def _check(plan, path) -> Path:
    if not isinstance(plan, GraphPlan):
        raise TypeError(f"wants a GraphPlan (from plan_graph), got {type(plan).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ValueError(f"cannot write {str(path)!r}: use one of {', '.join(FORMATS)}")
    if not path.parent.is_dir():
        raise ValueError(f"cannot write {str(path)!r}: directory {str(path.parent)!r} "
                         "does not exist")
    return path


def _unit(n_bytes: int) -> tuple[str, int]:
    if n_bytes >= 4 << 20:
        return "MiB", 1 << 20
    if n_bytes >= 4 << 10:
        return "KiB", 1 << 10
    return "bytes", 1


def node_layers(plan: GraphPlan) -> list[int | None]:
    """Layer of each node: the layer of the first of its outputs that has one."""
    tensors = plan.graph.tensors
    layers = []
    for node in plan.graph.nodes:
        found = [tensors[n].layer for n in node.outputs if tensors[n].layer is not None]
        layers.append(found[0] if found else None)
    return layers


def _layer_bands(ax, plan: GraphPlan) -> None:
    """Light bands on alternate layers, with layer numbers along the top, so a 30-layer graph
    reads as 30 repeats instead of 900 anonymous node indices."""
    spans: dict[int, list[int]] = {}
    for i, layer in enumerate(node_layers(plan)):
        if layer is not None:
            span = spans.setdefault(layer, [i, i])
            span[1] = i
    if len(spans) < 2:
        return
    step = max(1, len(spans) // 15)  # at most ~15 labels along the top
    for k, layer in enumerate(sorted(spans)):
        lo, hi = spans[layer]
        if k % 2 == 0:
            ax.axvspan(lo - 0.5, hi + 0.5, color="0.93", zorder=0, lw=0)
        if k % step == 0:
            ax.text((lo + hi) / 2, 1.005, f"L{layer}", transform=ax.get_xaxis_transform(),
                    ha="center", va="bottom", fontsize=7, color="0.35")


def _bound_lines(ax, plan: GraphPlan, scale: int, unit: str) -> None:
    # Labels inside the plot at the left: arena above its line, lower bound below its own, so
    # they never collide however close the two figures are.
    arena, bound = plan.arena_size / scale, plan.lower_bound / scale
    box = dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.8)
    ax.axhline(arena, color="black", lw=1.2, zorder=4)
    ax.axhline(bound, color="crimson", lw=1.2, ls="--", zorder=4)
    ax.text(0.005, arena, f"arena {arena:.4g} {unit}", transform=ax.get_yaxis_transform(),
            va="bottom", fontsize=8, zorder=6, bbox=box)
    ax.text(0.005, bound, f"lower bound {bound:.4g} {unit}", color="crimson", va="top",
            transform=ax.get_yaxis_transform(), fontsize=8, zorder=6, bbox=box)


def static_ranges(plan: GraphPlan) -> list[tuple[int, int]]:
    """Merged byte ranges held by tensors that live over the whole graph (KV caches, preserved
    tensors): nothing else can ever use those bytes. Sorted by offset."""
    end = len(plan.graph.nodes) - 1
    spans = sorted((plan.offsets[n], plan.offsets[n] + align_up(plan.sizes[n], plan.alignment))
                   for n, (first, last) in planned_lifetimes(plan).items()
                   if first == 0 and last == end)
    merged: list[list[int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def _squeezed_ticks(static, top: float, scale: int, forward) -> list[float]:
    """Ticks at the edges of the squeezed ranges, plus round values inside the unsqueezed
    ones, as many as each gets screen height for."""
    from matplotlib.ticker import MaxNLocator

    edges = sorted({0.0, top, *(v / scale for lo_hi in static for v in lo_hi)})
    static_set = {(lo / scale, hi / scale) for lo, hi in static}
    ticks = set(edges)
    total = forward(top) or 1.0
    for lo, hi in zip(edges, edges[1:]):
        share = (forward(hi) - forward(lo)) / total
        if (lo, hi) in static_set or share < 0.08:
            continue
        values = MaxNLocator(nbins=max(2, round(10 * share))).tick_values(lo, hi)
        # keep round ticks clear of the edges so labels do not print on top of each other
        gap = (hi - lo) * 0.2
        ticks.update(v for v in values if lo + gap < v < hi - gap)
    return sorted(ticks)


def _squeeze_y(ax, static, top: int, scale: int, unit: str, what: str) -> None:
    """When byte ranges that never change (KV caches and other whole-graph tensors) hold most
    of the height, everything that actually varies shrinks to slivers. Draw those ranges
    squeezed to a quarter of the height with a piecewise-linear y scale; tick labels stay in
    true units. static: sorted, disjoint (lo, hi) byte ranges below top."""
    from matplotlib.ticker import FixedLocator

    s_bytes = sum(hi - lo for lo, hi in static)
    t_bytes = top - s_bytes
    if s_bytes <= t_bytes or t_bytes <= 0:
        return
    squeeze = t_bytes / 3 / s_bytes
    knots_in, knots_out = [0.0], [0.0]

    def add(y, weight):
        knots_out.append(knots_out[-1] + (y - knots_in[-1]) * weight)
        knots_in.append(y)

    for lo, hi in static:
        if lo > knots_in[-1]:
            add(lo / scale, 1.0)
        add(hi / scale, squeeze)
    add(top / scale * 2 + 1, 1.0)  # headroom above the top, unsqueezed
    x_in, x_out = np.array(knots_in), np.array(knots_out)  # [n_knots] increasing

    def forward(y):
        return np.interp(y, x_in, x_out)

    def inverse(y):
        return np.interp(y, x_out, x_in)

    ax.set_yscale("function", functions=(forward, inverse))
    ax.set_ylim(0, float(inverse(forward(top / scale) * 1.05)))
    ax.yaxis.set_major_locator(FixedLocator(_squeezed_ticks(static, top / scale, scale,
                                                            forward)))
    ax.text(0.995, 0.5 * (static[0][0] + static[0][1]) / scale,
            f"{what}: {s_bytes / scale:.4g} {unit}, drawn {1 / squeeze:.0f}x squeezed",
            transform=ax.get_yaxis_transform(), ha="right", va="center", fontsize=8, zorder=6,
            bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="0.7"))


def _node_axis(ax, n_nodes: int) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # nodes are whole numbers
    ax.set_xlim(-0.5, n_nodes - 0.5)
    ax.set_xlabel("node index (execution order)")


def _title(plan: GraphPlan) -> str:
    ratio = plan.arena_size / plan.lower_bound if plan.lower_bound else 1.0
    mode = ", preserve_all" if plan.preserve_all else ""
    return (f"{plan.graph.name}: {len(plan.offsets)} tensors, {len(plan.graph.nodes)} nodes, "
            f"strategy {plan.strategy}{mode}; arena / lower bound = {ratio:.3f}")


def plot_arena(plan: GraphPlan, path, color_by: str = "op", dpi: int = 110) -> Path:
    """One box per planned tensor: x spans its lifetime (nodes), y its bytes in the arena.
    color_by 'op' (the op that writes it) or 'layer'. Returns the path written."""
    path = _check(plan, path)
    if color_by not in ("op", "layer"):
        raise ValueError(f"color_by={color_by!r}: use 'op' or 'layer'")
    from matplotlib.collections import PatchCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    rows = report(plan).rows
    unit, scale = _unit(plan.arena_size)
    n_nodes = len(plan.graph.nodes)
    fig = Figure(figsize=(15, 7.5), dpi=dpi, layout="constrained")
    ax = fig.add_subplot()
    boxes = [Rectangle((r.lifetime[0] - 0.5, r.offset / scale), r.lifetime[1] - r.lifetime[0] + 1,
                       r.size / scale) for r in rows]
    if color_by == "op":
        colors, handles = _op_colors(rows)
    else:
        colors, handles = _layer_colors(rows, fig, ax)
    # Thin light edges keep neighbours apart without hiding one-node-wide boxes.
    ax.add_collection(PatchCollection(boxes, facecolors=colors, edgecolors="white",
                                      linewidths=0.3, zorder=2))
    _bound_lines(ax, plan, scale, unit)
    _layer_bands(ax, plan)
    _node_axis(ax, n_nodes)
    ax.set_ylim(0, max(plan.arena_size, plan.lower_bound, 1) / scale * 1.05)
    _squeeze_y(ax, static_ranges(plan), max(plan.arena_size, plan.lower_bound), scale, unit,
               "whole-graph tensors")
    _label_big_boxes(ax, rows, scale)
    ax.set_ylabel(f"arena offset ({unit})")
    ax.set_title(_title(plan), fontsize=10, pad=14)
    if handles:
        ax.legend(handles=[Patch(color=c, label=l) for l, c in handles], loc="upper left",
                  bbox_to_anchor=(1.01, 1.0), fontsize=8, title="written by" if
                  color_by == "op" else None, frameon=False)
    fig.savefig(path)
    return path


def _op_colors(rows):
    """Ops ordered by how many bytes they write (ties by name): the biggest get the most
    distinct colours; beyond the palette they share light grey as 'other'. Caller-written
    tensors ('input') are always dark grey, listed first."""
    volume: dict[str, int] = {}
    for r in rows:
        volume[r.op] = volume.get(r.op, 0) + r.size
    ops = sorted((op for op in volume if op != INPUT_OP), key=lambda op: (-volume[op], op))
    named = ops if len(ops) <= len(PALETTE) else ops[:len(PALETTE) - 1]
    color = {op: PALETTE[k] for k, op in enumerate(named)}
    color[INPUT_OP] = INPUT_COLOR
    colors = [color.get(r.op, "#c7c7c7") for r in rows]
    handles = [(INPUT_OP, INPUT_COLOR)] * (INPUT_OP in volume) + [(op, color[op]) for op in named]
    if len(named) < len(ops):
        handles.append((f"other ({len(ops) - len(named)} ops)", "#c7c7c7"))
    return colors, handles


def _layer_colors(rows, fig, ax):
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    layers = [r.layer for r in rows if r.layer is not None]
    lo, hi = (min(layers), max(layers)) if layers else (0, 1)
    norm = Normalize(lo, max(hi, lo + 1))
    cmap = colormaps["viridis"]
    colors = [cmap(norm(r.layer)) if r.layer is not None else "#c7c7c7" for r in rows]
    label = "layer" + (" (grey: none)" if len(layers) < len(rows) else "")
    fig.colorbar(ScalarMappable(norm, cmap), ax=ax, label=label, pad=0.01, fraction=0.02,
                 aspect=40)
    return colors, []


def _label_big_boxes(ax, rows, scale: int) -> None:
    """Name only the boxes whose name fits inside them on screen (measured in pixels after the
    limits and the y scale are set), largest first, at most MAX_LABELS."""
    if not rows:
        return
    lo = np.array([(r.lifetime[0] - 0.5, r.offset / scale) for r in rows])  # [n, 2]
    hi = np.array([(r.lifetime[1] + 0.5, (r.offset + r.size) / scale) for r in rows])  # [n, 2]
    px = np.abs(ax.transData.transform(hi) - ax.transData.transform(lo))  # [n, 2] pixels
    char_px = 7 * ax.figure.dpi / 72 * 0.6  # rough width of one 7-pt character
    fits = [k for k, r in enumerate(rows)
            if px[k, 0] >= char_px * len(r.name) + 4 and px[k, 1] >= 12]
    fits.sort(key=lambda k: (-px[k, 0] * px[k, 1], rows[k].name))
    for k in fits[:MAX_LABELS]:
        r = rows[k]
        ax.text((r.lifetime[0] + r.lifetime[1]) / 2, (r.offset + r.size / 2) / scale, r.name,
                ha="center", va="center", fontsize=7, zorder=5, clip_on=True,
                bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.7))


def live_bytes_by_kind(plan: GraphPlan) -> dict[str, np.ndarray]:
    """Aligned bytes live at each node per tensor kind, from the plan's lifetimes. [n_nodes]"""
    n = len(plan.graph.nodes)
    lifetimes = planned_lifetimes(plan)
    deltas: dict[str, np.ndarray] = {}
    for name, (first, last) in lifetimes.items():
        kind = plan.graph.tensors[name].kind
        d = deltas.setdefault(kind, np.zeros(n + 1, dtype=np.int64))  # [n_nodes + 1]
        size = align_up(plan.sizes[name], plan.alignment)
        d[first] += size
        d[last + 1] -= size
    order = ("persistent", "input", "output", "intermediate", "scratch")
    return {k: np.cumsum(deltas[k])[:n] for k in order if k in deltas}


def plot_memory_timeline(plan: GraphPlan, path, dpi: int = 110) -> Path:
    """Live bytes at every node, stacked by tensor kind, against the arena size and the lower
    bound. The gap between the top of the stack and the arena line is fragmentation at that
    node. Returns the path written."""
    path = _check(plan, path)
    from matplotlib.figure import Figure

    unit, scale = _unit(max(plan.arena_size, plan.lower_bound))
    stacks = live_bytes_by_kind(plan)
    n_nodes = len(plan.graph.nodes)
    x = np.arange(n_nodes)  # [n_nodes]
    fig = Figure(figsize=(15, 5), dpi=dpi, layout="constrained")
    ax = fig.add_subplot()
    colors = {"persistent": "#9c755f", "input": "#76b7b2", "output": "#59a14f",
              "intermediate": "#4e79a7", "scratch": "#f28e2b"}
    ax.stackplot(x, *[v / scale for v in stacks.values()], labels=list(stacks), step="mid",
                 colors=[colors[k] for k in stacks], alpha=0.85, zorder=2)
    total = sum(stacks.values()) if stacks else np.zeros(n_nodes)
    if n_nodes:
        peak = int(np.argmax(total))
        ax.annotate(f"peak {total[peak] / scale:.4g} {unit} at node {peak} "
                    f"({plan.graph.nodes[peak]})", (peak, total[peak] / scale),
                    xytext=(25 if peak < n_nodes / 2 else -25, -30), textcoords="offset points",
                    fontsize=8, zorder=7,
                    ha="left" if peak < n_nodes / 2 else "right",
                    arrowprops=dict(arrowstyle="->", color="0.2"),
                    bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="0.7"))
    _bound_lines(ax, plan, scale, unit)
    _layer_bands(ax, plan)
    _node_axis(ax, n_nodes)
    top = max(plan.arena_size, plan.lower_bound, 1)
    ax.set_ylim(0, top / scale * 1.08)
    persistent = stacks.get("persistent")
    if persistent is not None and persistent.min() == persistent.max() > 0:
        _squeeze_y(ax, [(0, int(persistent[0]))], top, scale, unit, "persistent tensors")
    ax.set_ylabel(f"live bytes ({unit})")
    ax.set_title(_title(plan), fontsize=10, pad=14)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False,
              title="tensor kind")
    fig.savefig(path)
    return path
