"""Graph IR validation: every broken rule raises GraphError naming the node and the tensor."""
import pytest
from hypothesis import given, settings, strategies as st

from magnitude.errors import GraphError, MagnitudeError
from magnitude.graph import DTYPES, Graph, row_bytes


def small_graph():
    g = Graph("g")
    g.add_tensor("x", (4, 32), "f32", "input")
    g.add_tensor("w", (8, 32), "q4_0", "weight")
    g.add_tensor("h", (4, 8), "f32")
    g.add_tensor("y", (4, 8), "f32", "output")
    g.add_tensor("kv", (16,), "f32", "persistent")
    g.add_tensor("tmp", (64,), "f32", "scratch")
    return g


def test_a_valid_graph_passes():
    g = small_graph()
    g.add_node("matmul", ["w", "x"], ["h", "tmp"])
    g.add_node("cache", ["h", "kv"], ["kv"])
    g.add_node("cache", ["kv"], ["kv"])  # persistent tensors may be updated in place
    g.add_node("relu", ["h"], ["y"])
    g.validate()
    assert g.inputs == ["x"] and g.outputs == ["y"]


def test_unknown_tensor_names_node_and_tensor():
    g = small_graph()
    g.add_node("matmul", ["w", "nope"], ["h"], name="proj")
    with pytest.raises(GraphError, match=r"node 0 \(proj\) uses unknown tensor 'nope'"):
        g.validate()
    g = small_graph()
    g.add_node("matmul", ["w", "x"], ["ghost"])
    with pytest.raises(GraphError, match=r"node 0 \(matmul_0\).*'ghost'"):
        g.validate()


def test_written_twice_names_the_second_writer():
    g = small_graph()
    g.add_node("matmul", ["w", "x"], ["h"])
    g.add_node("matmul", ["w", "x"], ["h"], name="again")
    with pytest.raises(GraphError, match=r"node 1 \(again\) writes tensor 'h', already written"):
        g.validate()


def test_read_before_written():
    g = small_graph()
    g.add_node("relu", ["h"], ["y"], name="early")
    g.add_node("matmul", ["w", "x"], ["h"])
    with pytest.raises(GraphError, match=r"node 0 \(early\) reads tensor 'h' before"):
        g.validate()


def test_read_only_and_private_tensors():
    g = small_graph()
    g.add_node("overwrite", ["x"], ["w"], name="bad")
    with pytest.raises(GraphError, match=r"node 0 \(bad\) writes weight tensor 'w'"):
        g.validate()
    g = small_graph()
    g.add_node("overwrite", ["w"], ["x"])
    with pytest.raises(GraphError, match=r"node 0 .* writes input tensor 'x'"):
        g.validate()
    g = small_graph()
    g.add_node("matmul", ["w", "x"], ["h", "tmp"])
    g.add_node("peek", ["tmp"], ["y"], name="peek")
    with pytest.raises(GraphError, match=r"node 1 \(peek\) reads scratch tensor 'tmp'"):
        g.validate()


def test_graph_level_rules():
    with pytest.raises(GraphError, match="'empty' has no nodes"):
        Graph("empty").validate()
    g = small_graph()
    g.add_node("matmul", ["w", "x"], ["h"])
    with pytest.raises(GraphError, match="output 'y' is never written"):
        g.validate()


@pytest.mark.parametrize("kwargs, match", [
    (dict(shape=(3, 48), dtype="q4_0"), r"'bad'.*48 values.*q4_0 blocks of 32"),
    (dict(shape=(10,), dtype="q8_1"), r"'bad'.*10 values.*q8_1"),
    (dict(shape=(4,), dtype="bf17"), r"'bad': unknown dtype 'bf17'"),
    (dict(shape=(4,), kind="temporary"), r"'bad': unknown kind 'temporary'"),
    (dict(shape=(4, 0)), r"'bad'.*dimension <= 0"),
])
def test_bad_tensor_definitions(kwargs, match):
    with pytest.raises(GraphError, match=match):
        Graph().add_tensor("bad", **kwargs)


def test_a_tensor_defined_twice():
    g = small_graph()
    with pytest.raises(GraphError, match="'x' is defined twice"):
        g.add_tensor("x", (4,))


def test_errors_are_magnitude_errors():
    assert issubclass(GraphError, MagnitudeError)
    with pytest.raises(GraphError, match="not a multiple of the q4_1 block size"):
        row_bytes(33, "q4_1")


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(sorted(DTYPES)), st.lists(st.integers(1, 6), min_size=0, max_size=3),
       st.integers(1, 4))
def test_nbytes_is_rows_times_row_bytes(dtype, outer, blocks):
    block, block_bytes = DTYPES[dtype]
    shape = tuple(outer) + (blocks * block,)
    g = Graph()
    g.add_tensor("t", shape, dtype)
    rows = 1
    for d in outer:
        rows *= d
    assert g.tensors["t"].nbytes == rows * blocks * block_bytes
