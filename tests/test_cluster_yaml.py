"""cluster.yaml passes Ray's own cluster-launcher validation, offline."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTER_YAML = Path(__file__).resolve().parents[1] / "cluster.yaml"


def _load() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def test_cluster_yaml_is_valid_for_ray_up():
    config = prepare_config(_load())
    validate_config(config)  # what `ray up` runs before touching the cloud
    workers = config["available_node_types"]["gpu_worker"]
    assert workers["min_workers"] >= 1
    start = " ".join(config["worker_start_ray_commands"])
    assert "RAY_GOODPUT_STAGING_DIR=/mnt/nvme" in start and "RAY_GOODPUT_CACHE_DIR=/mnt/nvme" in start
    assert any("mdadm" in c and "/mnt/nvme" in c for c in config["initialization_commands"])
    assert any("ray-goodput" in c for c in config["setup_commands"])


def test_validation_would_catch_a_broken_config():
    config = _load()
    config["max_workers"] = "many"
    with pytest.raises(Exception, match="many"):
        validate_config(prepare_config(config))
