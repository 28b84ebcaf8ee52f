"""Where new stage reservations aim (runtime.placement.choose_nodes, pure)."""

from elastic_llm.runtime.placement import choose_nodes


def test_packed_fills_the_roomiest_node_first_then_the_next():
    assert choose_nodes({"a": 1, "b": 3, "c": 2}, 4, spread=False) == ["b", "b", "b", "c"]


def test_spread_puts_one_per_node_round_after_round():
    assert choose_nodes({"a": 1, "b": 3, "c": 2}, 5, spread=True) == ["b", "c", "a", "b", "c"]


def test_preferred_nodes_come_first_while_they_have_room():
    # the replica's other stages run on "a": its lost stage goes back there, then the roomiest
    assert choose_nodes({"a": 1, "b": 3}, 2, spread=False, prefer=["a"]) == ["a", "b"]
    assert choose_nodes({"a": 0, "b": 3}, 1, spread=False, prefer=["a"]) == ["b"]


def test_bundles_beyond_the_free_room_get_no_target():
    assert choose_nodes({"a": 1}, 3, spread=False) == ["a", None, None]
    assert choose_nodes({}, 2, spread=True) == [None, None]


def test_ties_break_by_node_id_so_the_choice_is_reproducible():
    assert choose_nodes({"z": 2, "m": 2, "a": 2}, 3, spread=True) == ["a", "m", "z"]
