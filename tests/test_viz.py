"""Plots of a plan: files written, valid, and the helpers they rest on agree with the arena."""
import dataclasses

import numpy as np
import pytest

from magnitude.graph import Graph
from magnitude.viz import (live_bytes_by_kind, node_layers, plot_arena, plot_memory_timeline,
                           static_ranges)
from test_arena import chain_graph, hand_plan, plan, transformer_graph

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def big_plan():
    return plan(transformer_graph())


def assert_png(path, min_bytes=10_000):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) >= min_bytes


@pytest.mark.parametrize("color_by", ["op", "layer"])
def test_plot_arena_of_a_30_layer_graph(big_plan, tmp_path, color_by):
    out = plot_arena(big_plan, tmp_path / f"arena_{color_by}.png", color_by=color_by)
    assert out == tmp_path / f"arena_{color_by}.png"
    assert_png(out)


def test_plot_memory_timeline_of_a_30_layer_graph(big_plan, tmp_path):
    assert_png(plot_memory_timeline(big_plan, str(tmp_path / "live.png")))


def test_small_and_preserve_all_plans_plot_too(tmp_path):
    g = chain_graph()
    for k, p in enumerate((plan(g), plan(g, preserve_all=True), hand_plan())):
        assert_png(plot_arena(p, tmp_path / f"a{k}.png"), 2_000)
        assert_png(plot_memory_timeline(p, tmp_path / f"t{k}.png"), 2_000)
    svg = plot_arena(plan(g), tmp_path / "a.svg")
    assert svg.read_text().lstrip().startswith("<?xml")


def test_bad_input_is_rejected_with_the_value_named(tmp_path):
    p = plan(chain_graph())
    with pytest.raises(TypeError, match="GraphPlan"):
        plot_arena({"a": 0}, tmp_path / "x.png")
    with pytest.raises(TypeError, match="path must be"):
        plot_memory_timeline(p, 42)
    with pytest.raises(ValueError, match=r"x\.jpg"):
        plot_arena(p, tmp_path / "x.jpg")
    with pytest.raises(ValueError, match="does not exist"):
        plot_memory_timeline(p, tmp_path / "missing" / "x.png")
    with pytest.raises(ValueError, match="color_by='kind'"):
        plot_arena(p, tmp_path / "x.png", color_by="kind")
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_live_bytes_by_kind_sums_to_the_lower_bound_sweep():
    p = hand_plan()
    stacks = live_bytes_by_kind(p)
    total = sum(stacks.values())
    # node 0: x (64 aligned) + a + b; node 1: a + b; node 2: b + c; node 3: b + d
    assert total.tolist() == [64 + 2048, 2048, 2048, 2048]
    assert total.max() == p.lower_bound
    assert stacks["output"].tolist() == [1024, 1024, 1024, 2048]
    assert list(stacks) == ["input", "output", "intermediate"]  # persistent first when present


def test_static_ranges_merge_whole_graph_tensors():
    g = Graph("static")
    g.add_tensor("x", (4,), kind="input")
    for name in ("k", "v"):
        g.add_tensor(name, (16, 16), kind="persistent")
    g.add_tensor("y", (16, 16), kind="output")
    g.add_node("f", ["x", "k", "v"], ["k", "v"])
    g.add_node("g", ["k"], ["y"])
    p = plan(g)
    p = dataclasses.replace(p, lifetimes={**p.lifetimes, "k": (0, 1), "v": (0, 1)},
                            offsets={**p.offsets, "k": 0, "v": 1024, "y": 2048, "x": 3072},
                            arena_size=3136)
    assert static_ranges(p) == [(0, 2048)]  # k and v touch: one range; y starts at node 1
    assert static_ranges(dataclasses.replace(p, preserve_all=True)) == [(0, 3136)]


def test_squeezed_axis_gives_the_static_band_a_quarter_of_the_height():
    from matplotlib.figure import Figure

    from magnitude.viz import _squeeze_y

    ax = Figure().add_subplot()
    ax.set_ylim(0, 1000)
    _squeeze_y(ax, [(0, 900)], 1000, 1, "bytes", "static")
    assert ax.get_yscale() == "function"
    y0, y900, y1000 = ax.transData.transform([(0, 0), (0, 900), (0, 1000)])[:, 1]
    assert (y900 - y0) / (y1000 - y0) == pytest.approx(0.25)
    ax2 = Figure().add_subplot()
    _squeeze_y(ax2, [(0, 400)], 1000, 1, "bytes", "static")  # under half: left linear
    assert ax2.get_yscale() == "linear"


def test_node_layers_follow_the_outputs(big_plan):
    layers = node_layers(big_plan)
    assert layers[0] is None and layers[-1] is None  # embed and the head
    assert layers[1] == 0 and layers[-2] == 29
    assert np.all(np.diff([x for x in layers if x is not None]) >= 0)


def test_op_colours_stay_distinct_and_lump_the_smallest_ops():
    from magnitude.arena import TensorRow
    from magnitude.viz import INPUT_COLOR, PALETTE, _op_colors

    rows = [TensorRow(f"t{k}", "intermediate", None, f"op{k:02d}", 0, 100 + k, (0, 0), 0)
            for k in range(20)] + [TensorRow("x", "input", None, "input", 0, 4, (0, 0), 0)]
    colors, handles = _op_colors(rows)
    assert handles[0] == ("input", INPUT_COLOR) and colors[-1] == INPUT_COLOR
    named = [label for label, _ in handles[1:-1]]
    assert named == [f"op{k:02d}" for k in range(19, 19 - len(PALETTE) + 1, -1)]  # by bytes
    assert handles[-1][0] == f"other ({20 - len(named)} ops)"
    assert len({c for _, c in handles}) == len(handles)  # every legend entry its own colour
    assert colors[0] == "#c7c7c7"  # the smallest op is lumped
