"""The placement arithmetic Recovery decides with (``driver/_placement.py``), as pure
functions of the node table ``ray.nodes()`` returns (its entries as data)."""

from __future__ import annotations

from ray.train import ScalingConfig

from ray_goodput.driver._placement import candidate_nodes, room


def _node(node_id: str, resources: dict[str, float], labels: dict[str, str] | None = None, alive: bool = True) -> dict:
    return {"NodeID": node_id, "Alive": alive, "Resources": resources, "Labels": labels or {}}


def test_room_counts_only_nodes_of_the_requested_accelerator_type():
    # Ray adds accelerator_type:<T> to each worker's resources; the room Recovery counted
    # did not, so A10G GPUs counted as room for H100 workers: the last H100 node could be
    # isolated, and Ray then waited for capacity for ever (its placement retried unbounded).
    nodes = [
        _node("h", {"GPU": 8.0, "CPU": 64.0, "accelerator_type:H100": 1.0}),
        _node("a", {"GPU": 8.0, "CPU": 64.0, "accelerator_type:A10G": 1.0}),
    ]
    scaling = ScalingConfig(num_workers=8, use_gpu=True, accelerator_type="H100")
    assert room(scaling, [], nodes=nodes) == 8
    assert room(scaling, ["h"], nodes=nodes) == 0
    assert candidate_nodes(scaling, [], nodes=nodes) == ["h"]


def test_room_counts_only_nodes_the_users_label_selector_admits():
    nodes = [
        _node("x", {"CPU": 4.0}, {"pool": "train", "zone": "a"}),
        _node("y", {"CPU": 4.0}, {"pool": "eval", "zone": "b"}),
        _node("z", {"CPU": 4.0}, {"zone": "c"}),
        _node("dead", {"CPU": 4.0}, {"pool": "train"}, alive=False),
    ]
    cases = {
        "train": ["x"],
        "!eval": ["x", "z"],  # a node without the label is not "eval"
        "in(train,eval)": ["x", "y"],
        "!in(train,eval)": ["z"],
    }
    for value, admitted in cases.items():
        scaling = ScalingConfig(num_workers=1, label_selector={"pool": value})
        assert candidate_nodes(scaling, [], nodes=nodes) == admitted, value
        assert room(scaling, [], nodes=nodes) == 4 * len(admitted), value
    both = ScalingConfig(num_workers=1, label_selector={"pool": "!eval", "zone": "in(a,b)"})
    assert candidate_nodes(both, [], nodes=nodes) == ["x"]
    assert room(ScalingConfig(num_workers=1), ["y"], nodes=nodes) == 8  # no selector: every live node but y
