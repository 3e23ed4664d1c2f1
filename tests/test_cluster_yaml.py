"""cluster.yaml passes the checks `ray up` makes before it talks to the cloud."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

pytest.importorskip("jsonschema")
from ray.autoscaler._private.util import prepare_config, validate_config

CONFIG = yaml.safe_load((Path(__file__).resolve().parent.parent / "cluster.yaml").read_text())


def test_cluster_yaml_validates_like_ray_up():
    validate_config(prepare_config(copy.deepcopy(CONFIG)))


def test_cluster_yaml_has_gpu_workers_that_install_the_project():
    gpu_types = [t for t in CONFIG["available_node_types"].values() if t["resources"].get("GPU", 0) >= 1]
    assert gpu_types and all("max_workers" in t for t in gpu_types)
    assert any("rrfp-ray[gpu]" in command for command in CONFIG["setup_commands"])


def test_a_broken_config_is_rejected():
    broken = copy.deepcopy(CONFIG)
    broken["head_node_type"] = "nonexistent"
    with pytest.raises(ValueError, match="head_node_type"):
        validate_config(prepare_config(broken))
