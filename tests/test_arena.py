"""Arena, simulate, sanitizer and report.

A tiny numpy executor runs graphs over arena views; the reference runs the same ops on private
arrays. A sound plan reproduces the reference bit for bit; a broken one is caught by simulate()
and, at run time, by the sanitizer turning results into NaN.
"""
import dataclasses
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from magnitude.arena import Arena, Report, reuse_counts, report, simulate
from magnitude.errors import PlanError
from magnitude.graph import Graph
from magnitude.planner import GraphPlan, plan_graph

STRATEGY = "greedy_by_size"  # fast and deterministic; the arena must not care which one
SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def plan(graph, **kw):
    return plan_graph(graph, strategy=STRATEGY, **kw)


# --- graphs ---------------------------------------------------------------------------------

def transformer_graph(n_layers=30, n_tok=16, d=576, d_ff=1536, n_head=9, d_kv=192, n_ctx=256):
    """A llama-shaped graph: a residual stream and, per layer, norm, quantized activations,
    q/k/v, rope, KV caches, attention, gate/up/act/down. 26 tensors and 26 nodes per layer."""
    g = Graph(f"transformer_{n_layers}L")
    t = g.add_tensor
    t("tokens", (n_tok,), "i32", kind="input")
    x = t("x.0", (n_tok, d))  # [n_tok, d]
    g.add_node("embed", ["tokens"], [x])
    for i in range(n_layers):
        def lt(name, shape, dtype="f32", kind="intermediate"):
            return t(f"{name}.{i}", shape, dtype, kind, layer=i)

        def node(op, ins, outs):
            g.add_node(op, ins, outs, name=f"{outs[0]}")

        h = lt("attn_norm", (n_tok, d))
        node("rmsnorm", [x], [h])
        hq = lt("attn_norm_q8", (n_tok, d), "q8_0")
        node("quantize", [h], [hq])
        q, k, v = lt("q", (n_tok, d)), lt("k", (n_tok, d_kv)), lt("v", (n_tok, d_kv))
        for out in (q, k, v):
            node("matmul", [hq], [out])
        qr, kr = lt("q_rope", (n_tok, d)), lt("k_rope", (n_tok, d_kv))
        node("rope", [q], [qr])
        node("rope", [k], [kr])
        ck = lt("cache_k", (n_ctx, d_kv), "f16", "persistent")
        cv = lt("cache_v", (n_ctx, d_kv), "f16", "persistent")
        node("kv_write", [kr], [ck])
        node("kv_write", [v], [cv])
        s = lt("scores", (n_head, n_tok, n_ctx))  # [n_head, n_tok, n_ctx]
        node("qk", [qr, ck], [s])
        s2 = lt("scores_scaled", (n_head, n_tok, n_ctx))
        node("scale", [s], [s2])
        s3 = lt("scores_masked", (n_head, n_tok, n_ctx))
        node("mask", [s2], [s3])
        p = lt("probs", (n_head, n_tok, n_ctx))
        node("softmax", [s3], [p])
        a = lt("attn", (n_tok, d))
        node("pv", [p, cv], [a])
        aq = lt("attn_q8", (n_tok, d), "q8_0")
        node("quantize", [a], [aq])
        ao = lt("attn_out", (n_tok, d))
        node("matmul", [aq], [ao])
        xm = lt("x_mid", (n_tok, d))
        node("add", [x, ao], [xm])
        h2 = lt("ffn_norm", (n_tok, d))
        node("rmsnorm", [xm], [h2])
        h2q = lt("ffn_norm_q8", (n_tok, d), "q8_0")
        node("quantize", [h2], [h2q])
        gate, up = lt("gate", (n_tok, d_ff)), lt("up", (n_tok, d_ff))
        node("matmul", [h2q], [gate])
        node("matmul", [h2q], [up])
        sg = lt("silu", (n_tok, d_ff))
        node("silu", [gate], [sg])
        act = lt("act", (n_tok, d_ff))
        node("mul", [sg, up], [act])
        actq = lt("act_q8", (n_tok, d_ff), "q8_0")
        node("quantize", [act], [actq])
        down = lt("down", (n_tok, d))
        node("matmul", [actq], [down])
        x = t(f"x.{i + 1}", (n_tok, d), layer=i)
        node("add", [xm, down], [x])
    t("logits", (1, 4096), kind="output")
    g.add_node("matmul", [x], ["logits"], name="logits")
    return g


def chain_graph():
    """x -> a = 2x, b = x + 3, c = b * b, y = a + c: a is live while b is born and dies."""
    g = Graph("chain")
    for name, kind in (("x", "input"), ("a", "intermediate"), ("b", "intermediate"),
                       ("c", "intermediate"), ("y", "output")):
        g.add_tensor(name, (8, 16), kind=kind)  # [8, 16] f32 = 512 bytes each
    g.add_node("scale2", ["x"], ["a"])
    g.add_node("add3", ["x"], ["b"])
    g.add_node("mul", ["b", "b"], ["c"])
    g.add_node("add", ["a", "c"], ["y"])
    return g


@st.composite
def random_graphs(draw):
    """Random DAGs of f32 tensors of varied sizes: inputs, a persistent tensor updated in
    place, intermediates, outputs and scratch."""
    g = Graph("random")
    avail = []
    for j in range(draw(st.integers(1, 3))):
        avail.append(g.add_tensor(f"in{j}", (draw(st.integers(1, 40)), 16), kind="input"))
    has_state = draw(st.booleans())
    if has_state:
        avail.append(g.add_tensor("state", (4, 16), kind="persistent"))
    for i in range(draw(st.integers(1, 14))):
        ins = draw(st.lists(st.sampled_from(avail), min_size=1, max_size=3, unique=True))
        kind = draw(st.sampled_from(["intermediate", "intermediate", "intermediate", "output"]))
        outs = [g.add_tensor(f"t{i}", (draw(st.integers(1, 40)), 16), kind=kind)]
        if draw(st.integers(0, 3)) == 0:
            outs.append(g.add_tensor(f"scratch{i}", (draw(st.integers(1, 20)), 16),
                                     kind="scratch"))
        if has_state and draw(st.integers(0, 4)) == 0:
            outs.append("state")
        g.add_node("mix", ins, outs)
        avail.append(outs[0])
    return g


# --- a tiny numpy executor --------------------------------------------------------------------

def compute(op, args, shape):
    if op == "scale2":
        return args[0] * 2
    if op == "add3":
        return args[0] + 3
    if op == "mul":
        return args[0] * args[1]
    if op == "add":
        return args[0] + args[1]
    if op == "mix":  # any input shapes -> [rows, 16]; bounded values, order-exact floats
        base = np.float32(sum(float(a.mean()) for a in args) * 0.5)
        return base + np.arange(np.prod(shape), dtype=np.float32).reshape(shape) / 64
    raise AssertionError(op)


def preset_values(graph):
    """Values for the tensors the caller writes before node 0 (inputs, persistent state)."""
    rng = np.random.default_rng(7)
    return {t.name: rng.integers(-4, 5, t.shape).astype(np.float32)
            for t in graph.tensors.values() if t.kind in ("input", "persistent")}


def run_reference(graph):
    values = preset_values(graph)
    for node in graph.nodes:
        for out in node.outputs:
            shape = graph.tensors[out].shape
            values[out] = compute(node.op, [values[n] for n in node.inputs], shape)
    return values


def run_arena(graph, arena):
    for name, value in preset_values(graph).items():
        arena.view(name)[...] = value
    for i, node in enumerate(graph.nodes):
        args = [arena.view(n) for n in node.inputs]
        results = [compute(node.op, args, graph.tensors[out].shape) for out in node.outputs]
        for out, value in zip(node.outputs, results):
            arena.view(out)[...] = value
        arena.after_node(i)


# --- views ----------------------------------------------------------------------------------

def typed_graph():
    g = Graph("typed")
    shapes = {"f32": (3, 5), "f16": (7, 3), "i32": (2, 9), "i8": (5, 13), "q4_0": (3, 64),
              "q4_1": (2, 32), "q8_0": (4, 64), "q8_1": (1, 96)}
    g.add_tensor("x", (4,), "i32", kind="input")
    names = []
    for dtype, shape in shapes.items():
        names.append(g.add_tensor(f"t_{dtype}", shape, dtype))
    g.add_node("make", ["x"], names)
    g.add_tensor("y", (4,), "f32", kind="output")
    g.add_node("use", names, ["y"])
    return g


def test_views_have_shape_dtype_and_alias_the_right_bytes():
    g = typed_graph()
    p = plan(g)
    arena = Arena(p, sanitize=False)
    assert arena.base_address % 64 == 0
    assert arena.buffer.ctypes.data == arena.base_address
    assert arena.nbytes == p.arena_size == arena.buffer.nbytes
    expected = {"f32": np.float32, "f16": np.float16, "i32": np.int32, "i8": np.int8}
    rng = np.random.default_rng(0)
    for name in sorted(p.offsets):
        t = g.tensors[name]
        v = arena.view(name)
        assert v is arena.view(name)  # cached
        assert v.ctypes.data % 64 == 0
        assert arena.address(name) == v.ctypes.data == arena.base_address + p.offsets[name]
        assert v.nbytes == t.nbytes
        if t.dtype in expected:
            assert v.dtype == expected[t.dtype] and v.shape == t.shape
        else:  # block rows: q8_0 [4, 64] -> [4, 2 blocks * 34 bytes]
            assert v.dtype == np.uint8 and v.shape[:-1] == t.shape[:-1]
        pattern = rng.integers(0, 256, t.nbytes, dtype=np.uint8)
        v.view(np.uint8).reshape(-1)[:] = pattern
        raw = arena.buffer[p.offsets[name]:p.offsets[name] + t.nbytes]
        assert np.array_equal(raw, pattern)
    assert arena.view("t_q8_0").shape == (4, 68)
    assert arena.view("t_q8_1").shape == (1, 108)


def test_view_of_unknown_weight_or_unplanned_tensor_is_a_clear_error():
    g = chain_graph()
    g.add_tensor("w", (16, 32), "q8_0", kind="weight")
    arena = Arena(plan(g), sanitize=False)
    with pytest.raises(PlanError, match="'nope'"):
        arena.view("nope")
    with pytest.raises(PlanError, match="'w' is a weight"):
        arena.view("w")
    with pytest.raises(PlanError, match="'w'"):
        arena.address("w")


def test_arena_rejects_tensor_past_the_end_and_misaligned_offsets():
    p = plan(chain_graph())
    with pytest.raises(PlanError, match=r"'y' .* runs past the arena end"):
        Arena(dataclasses.replace(p, offsets={**p.offsets, "y": p.arena_size - 64}))
    with pytest.raises(PlanError, match="'c' has offset 100"):
        Arena(dataclasses.replace(p, offsets={**p.offsets, "c": 100}))
    with pytest.raises(TypeError, match="GraphPlan"):
        Arena({"x": 0})


# --- bind -----------------------------------------------------------------------------------

def aligned_empty(shape, dtype):
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(n + 64, np.uint8)
    shift = -raw.ctypes.data % 64
    return raw[shift:shift + n].view(dtype).reshape(shape)


def test_bind_attaches_user_memory_without_copy():
    g = chain_graph()
    p = plan(g, buffer_handles=["x"])
    assert "x" not in p.offsets and p.external == ("x",)
    arena = Arena(p, sanitize=False)
    with pytest.raises(PlanError, match="'x' is not bound yet"):
        arena.view("x")
    with pytest.raises(PlanError, match="'x' is not bound yet"):
        arena.address("x")
    user = aligned_empty((8 * 16,), np.float32)  # flat is fine: same bytes, reshaped as a view
    arena.bind("x", user)
    assert arena.view("x").shape == (8, 16)
    assert np.shares_memory(arena.view("x"), user)
    assert arena.address("x") == user.ctypes.data
    user[:] = np.arange(128)
    run_arena_no_presets(g, arena)
    ref = 2 * user.reshape(8, 16) + (user.reshape(8, 16) + 3) ** 2
    assert np.array_equal(arena.view("y"), ref)


def run_arena_no_presets(graph, arena):
    for i, node in enumerate(graph.nodes):
        args = [arena.view(n) for n in node.inputs]
        arena.view(node.outputs[0])[...] = compute(node.op, args, None)
        arena.after_node(i)


def test_bind_checks_each_property_with_a_clear_error():
    p = plan(chain_graph(), buffer_handles=["x"])
    arena = Arena(p, sanitize=False)
    with pytest.raises(PlanError, match="'a' lives in the arena at offset"):
        arena.bind("a", aligned_empty((8, 16), np.float32))
    with pytest.raises(PlanError, match="'zz' is not a buffer handle"):
        arena.bind("zz", aligned_empty((8, 16), np.float32))
    with pytest.raises(ValueError, match=r"'x'.*dtype is float64.*float32"):
        arena.bind("x", aligned_empty((8, 16), np.float64))
    with pytest.raises(ValueError, match=r"'x'.*has 256 bytes.*needs 512"):
        arena.bind("x", aligned_empty((4, 16), np.float32))
    with pytest.raises(ValueError, match="'x'.*not C-contiguous"):
        arena.bind("x", aligned_empty((16, 8), np.float32).T)
    misaligned = aligned_empty((8 * 16 + 1,), np.float32)[1:]
    with pytest.raises(ValueError, match="'x'.*not 64-byte aligned"):
        arena.bind("x", misaligned)
    with pytest.raises(ValueError, match="'x'.*numpy array"):
        arena.bind("x", [0.0] * 128)
    with pytest.raises(PlanError, match="buffer handle 'nope' is not in graph 'chain'"):
        Arena(dataclasses.replace(p, external=("nope", "x")))


# --- simulate -------------------------------------------------------------------------------

@SETTINGS
@given(random_graphs())
def test_simulate_accepts_planned_graphs(g):
    for preserve_all in (False, True):
        p = plan(g, preserve_all=preserve_all)
        sim = simulate(p)
        assert len(sim.live_bytes) == len(g.nodes)
        assert sim.peak_live == p.lower_bound  # live bytes replay = the lower bound's sweep
        assert sim.high_water <= p.arena_size
        assert sim.live_bytes[sim.peak_node] == sim.peak_live


@SETTINGS
@given(random_graphs(), st.data())
def test_simulate_names_both_tensors_and_the_node_of_an_overlap(g, data):
    p = plan(g)
    names = sorted(p.offsets)
    pairs = [(a, b) for a in names for b in names
             if a < b and p.lifetimes[a][0] <= p.lifetimes[b][1]
             and p.lifetimes[b][0] <= p.lifetimes[a][1]]
    if not pairs:
        return
    a, b = data.draw(st.sampled_from(pairs))
    bad = dataclasses.replace(p, offsets={**p.offsets, b: p.offsets[a]},
                              arena_size=max(p.arena_size, p.offsets[a] + p.sizes[b]))
    with pytest.raises(PlanError) as err:
        simulate(bad)
    msg = str(err.value)
    # The first overlap found may be with a third tensor that also uses those bytes.
    assert "node" in msg and "share bytes" in msg
    assert f"'{b}'" in msg  # every new overlap involves the moved tensor


def test_simulate_overlap_message_exact():
    p = plan(chain_graph())
    bad = dataclasses.replace(p, offsets={**p.offsets, "b": p.offsets["a"]})
    with pytest.raises(PlanError, match=r"at node 1 \(add3_1\) tensors 'b' .* and 'a' .*"
                                        r"both live"):
        simulate(bad)


def test_simulate_rejects_missing_offset_past_end_and_short_lifetime():
    p = plan(chain_graph())
    offsets = dict(p.offsets)
    del offsets["c"]
    sizes = {k: v for k, v in p.sizes.items() if k != "c"}
    with pytest.raises(PlanError, match="'c'.*no offset"):
        simulate(dataclasses.replace(p, offsets=offsets, sizes=sizes))
    with pytest.raises(PlanError, match="'a'.*runs past the arena end"):
        simulate(dataclasses.replace(p, arena_size=p.offsets["a"] + 256))
    with pytest.raises(PlanError, match=r"lifetime of tensor 'a' is \(0, 1\).*nodes 0..3"):
        simulate(dataclasses.replace(p, lifetimes={**p.lifetimes, "a": (0, 1)}))
    with pytest.raises(PlanError, match="size of tensor 'b' is 100"):
        simulate(dataclasses.replace(p, sizes={**p.sizes, "b": 100}))
    with pytest.raises(TypeError, match="GraphPlan"):
        simulate(None)


# --- runs over the arena, sanitizer ----------------------------------------------------------

@SETTINGS
@given(random_graphs())
def test_sound_plans_reproduce_the_reference_exactly_under_the_sanitizer(g):
    ref = run_reference(g)
    arena = Arena(plan(g), sanitize=True)
    run_arena(g, arena)
    for name in g.outputs + [t for t in g.tensors if g.tensors[t].kind == "persistent"]:
        assert np.array_equal(arena.view(name), ref[name]), name


@SETTINGS
@given(random_graphs())
def test_preserve_all_keeps_every_intermediate_readable(g):
    ref = run_reference(g)
    p = plan(g, preserve_all=True)
    arena = Arena(p, sanitize=True)  # the sanitizer must not poison anything either
    run_arena(g, arena)
    for name, t in g.tensors.items():
        if t.kind in ("intermediate", "output"):
            assert np.array_equal(arena.view(name), ref[name]), name


def test_sanitizer_turns_a_broken_plan_into_nan():
    g = chain_graph()
    ref = run_reference(g)
    good = plan(g)
    for sanitize in (False, True):
        arena = Arena(good, sanitize=sanitize)
        run_arena(g, arena)
        assert np.array_equal(arena.view("y"), ref["y"])
    assert Arena(good, sanitize=True).dies_after(2) == ("b",)

    # b moved onto a while a is still live: b overwrites a, and once b dies its poison is a's.
    moved = dataclasses.replace(good, offsets={**good.offsets, "b": good.offsets["a"]})
    arena = Arena(moved, sanitize=False)
    run_arena(g, arena)
    assert not np.array_equal(arena.view("y"), ref["y"])  # silently wrong without it
    arena = Arena(moved, sanitize=True)
    run_arena(g, arena)
    assert np.isnan(arena.view("y")).all()
    with pytest.raises(PlanError, match="'b'.*'a'"):
        simulate(moved)

    # a's lifetime cut short: it is poisoned after node 1 though node 3 still reads it.
    short = dataclasses.replace(good, lifetimes={**good.lifetimes, "a": (0, 1)})
    arena = Arena(short, sanitize=True)
    run_arena(g, arena)
    assert np.isnan(arena.view("y")).all()
    with pytest.raises(PlanError, match="'a'"):
        simulate(short)


def test_sanitizer_poisons_integer_and_block_tensors_with_a5_bytes():
    g = Graph("ints")
    g.add_tensor("x", (4, 32), "f32", kind="input")
    g.add_tensor("xq", (4, 32), "q8_0")
    g.add_tensor("idx", (4,), "i32")
    g.add_tensor("y", (4, 32), "f32", kind="output")
    g.add_node("quantize", ["x"], ["xq"])
    g.add_node("argmax", ["x"], ["idx"])
    g.add_node("use", ["xq", "idx"], ["y"])
    p = plan(g)
    arena = Arena(p, sanitize=True)
    arena.view("xq")[...] = 1
    arena.view("idx")[...] = 1
    arena.after_node(2)
    assert (arena.view("xq") == 0xA5).all()
    assert (arena.view("idx").view(np.uint8) == 0xA5).all()
    with pytest.raises(ValueError, match="after_node\\(3\\)"):
        arena.after_node(3)


def test_sanitizer_switch_follows_the_environment(monkeypatch):
    p = plan(chain_graph())
    monkeypatch.setenv("MAGNITUDE_SANITIZE", "1")
    assert Arena(p).sanitize and np.isnan(Arena(p).view("a")).all()
    assert not Arena(p, sanitize=False).sanitize
    g = Graph("state")
    g.add_tensor("x", (4, 16), kind="input")
    g.add_tensor("cache", (8, 16), "f16", kind="persistent")
    g.add_tensor("y", (4, 16), kind="output")
    g.add_node("f", ["x", "cache"], ["y"])
    arena = Arena(plan(g))
    assert np.isnan(arena.view("x")).all() and np.isnan(arena.view("y")).all()
    assert (arena.view("cache") == 0).all()  # state starts zeroed, as in a normal arena
    monkeypatch.setenv("MAGNITUDE_SANITIZE", "0")
    arena = Arena(p)
    assert not arena.sanitize
    arena.view("a")[...] = 5
    arena.after_node(3)  # off: a no-op
    assert (arena.view("a") == 5).all() and arena.dies_after(3) == ()


# --- report ---------------------------------------------------------------------------------

def hand_plan():
    """Four 1 KiB tensors placed by hand:
        a [0, 1024)     nodes 0..1
        b [1024, 2048)  nodes 0..3   (an output; shares with nobody)
        c [0, 1024)     nodes 2..2   (reuses a's bytes)
        d [0, 1024)     nodes 3..3   (reuses a's and c's bytes)"""
    g = Graph("hand")
    g.add_tensor("x", (4,), kind="input")
    for name, kind in (("a", "intermediate"), ("b", "output"), ("c", "intermediate"),
                       ("d", "output")):
        g.add_tensor(name, (16, 16), kind=kind, layer=0 if name in "ab" else 1)
    g.add_node("f", ["x"], ["a", "b"])
    g.add_node("g", ["a"], [])  # a's last reader
    g.add_node("h", ["b"], ["c"])  # c is never read: it lives at node 2 only
    g.add_node("k", ["b"], ["d"])
    lifetimes = {"x": (0, 0), "a": (0, 1), "b": (0, 3), "c": (2, 2), "d": (3, 3)}
    offsets = {"x": 2048, "a": 0, "b": 1024, "c": 0, "d": 0}
    sizes = {"x": 16, "a": 1024, "b": 1024, "c": 1024, "d": 1024}
    return GraphPlan(g, offsets, sizes, lifetimes, arena_size=2112, lower_bound=2112,
                     external=(), strategy="by hand", alignment=64, preserve_all=False)


def test_report_counts_reuse_and_flags_large_unshared_tensors():
    p = hand_plan()
    simulate(p)  # the hand plan is sound
    r = report(p)
    assert isinstance(r, Report)
    by_name = {row.name: row for row in r.rows}
    assert [row.name for row in r.rows] == ["a", "c", "d", "b", "x"]  # by offset, then first
    assert {n: by_name[n].reuse for n in by_name} == {"a": 2, "b": 0, "c": 2, "d": 2, "x": 0}
    assert by_name["a"].op == "f" and by_name["c"].op == "h" and by_name["x"].op == "input"
    assert by_name["c"].layer == 1 and by_name["c"].lifetime == (2, 2)
    assert r.naive_total == 4 * 1024 + 64
    assert r.large_unshared == ("b",)  # x is unshared too, but tiny
    assert r.ratio == 1.0
    text = str(r)
    assert "5 tensors" in text and "b" in text and "large, unshared" in text
    assert r.unshared_bytes() == {"output": (1024, 1), "input": (64, 1)}
    assert "bytes nobody else uses: 1.06 KiB (52% of the arena)" in text
    assert report(p, large_fraction=0).large_unshared == ("b", "x")
    table = r.table(limit=2, sort="size")
    assert table.count("\n") == 4 and "3 more" in table
    with pytest.raises(ValueError, match="sort='name'"):
        r.table(sort="name")
    with pytest.raises(ValueError, match="large_fraction=2"):
        report(p, large_fraction=2)


def test_reuse_counts_match_a_slow_oracle():
    rng = np.random.default_rng(3)
    n = 300
    off = rng.integers(0, 50, n) * 64
    size = rng.integers(1, 400, n)
    first = rng.integers(0, 40, n)
    last = first + rng.integers(0, 10, n)
    fast = reuse_counts(off, size, first, last)
    for i in range(0, n, 7):
        slow = sum(1 for j in range(n)
                   if j != i and off[i] < off[j] + size[j] and off[j] < off[i] + size[i]
                   and (last[i] < first[j] or last[j] < first[i]))
        assert fast[i] == slow


def test_report_and_simulate_are_fast_on_a_30_layer_graph():
    g = transformer_graph()
    p = plan(g)
    assert len(p.offsets) > 700 and len(g.nodes) > 750
    start = time.perf_counter()
    sim = simulate(p)
    r = report(p)
    text = str(r)
    elapsed = time.perf_counter() - start
    assert elapsed < 3.0, elapsed
    assert sim.peak_live == p.lower_bound
    assert len(r.rows) == len(p.offsets)
    # the KV caches live the whole graph: they are never reused
    assert all(row.reuse == 0 for row in r.rows if row.kind == "persistent")
    assert "transformer_30L" in text
    # and the arena is usable at that size
    arena = Arena(p, sanitize=True)
    assert all(arena.view(n).ctypes.data % 64 == 0 for n in p.offsets)


def test_persistent_tensors_read_mid_graph_keep_their_bytes_to_the_end():
    """A KV cache read at node 1 is still the KV cache after the last node: nothing born
    later may take its bytes."""
    g = Graph("cache")
    g.add_tensor("x", (16, 16), kind="input")
    g.add_tensor("cache", (16, 16), kind="persistent")
    g.add_tensor("a", (16, 16))
    g.add_tensor("b", (16, 16))
    g.add_tensor("y", (16, 16), kind="output")
    g.add_node("write", ["x"], ["cache"])
    g.add_node("read", ["cache"], ["a"])
    g.add_node("f", ["a"], ["b"])
    g.add_node("g", ["b"], ["y"])
    p = plan(g)
    simulate(p)
    assert p.lifetimes["cache"] == (0, 3)
