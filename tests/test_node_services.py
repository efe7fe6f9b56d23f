"""The node services' lookup-or-create (``runtime/_services.get_or_create``) as pure logic,
with a stand-in for the ``@ray.remote`` class: how it meets a failure inside Ray's own
lookup. The real services are created and found in test_uploader*, test_data_cache and
test_cluster_launch."""

from __future__ import annotations

import pytest

from ray_goodput.runtime import _services

NODE = "ab" * 28  # a node id's shape (Ray checks it)


class _RacyActorClass:
    """Stands in for a ``@ray.remote`` class whose ``.options(get_if_exists=True).remote()``
    fails ``failures`` times as Ray 2.60 did once in the CI soak: the actor existed, and
    reading its class back from GCS gave ``AssertionError: Expected str or bytes, got
    <class 'NoneType'>`` (ray-project/ray#41324's race on actor metadata)."""

    def __init__(self, failures: int) -> None:
        self.failures, self.calls = failures, 0

    def options(self, **options: object) -> _RacyActorClass:
        assert options["get_if_exists"] and options["name"] == f"kind:{NODE}"
        return self

    def remote(self, *args: object, **kwargs: object) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise AssertionError("Expected str or bytes, got <class 'NoneType'>")
        return "handle"


def test_a_node_service_lookup_that_fails_inside_ray_while_the_service_is_created_is_tried_again():
    # Before: the first failure ended the worker's Checkpointer() (a failed run in the soak).
    racy = _RacyActorClass(failures=2)
    assert _services.get_or_create(racy, "kind", node_id=NODE) == "handle"
    assert racy.calls == 3


def test_a_node_service_lookup_that_keeps_failing_inside_ray_raises_after_its_bound():
    racy = _RacyActorClass(failures=100)
    with pytest.raises(AssertionError):
        _services.get_or_create(racy, "kind", node_id=NODE)
    assert racy.calls == _services.LOOKUP_TRIES
