"""Resume contract end to end: real ranks over gloo (``run_world``) attached to the shared
Ray, so each node's cache actor serves them; loader worker processes; real S3; world size
2 -> 3 and 2 -> 1. (The data position restored by Ray Train workers from a checkpoint, on
fewer workers after a node loss, is ``test_restart_fidelity``'s; here three fits would cost
~30 s of worker-group starts for the same DataLoader code.)"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import ray

from ray_goodput.data import CacheConfig, DataLoader, FileDataset
from ray_goodput.data import _partition as part
from ray_goodput.testing import run_world

N, BATCH, STEPS_BEFORE = 62, 4, 3


pytestmark = pytest.mark.usefixtures("ray_local")


@pytest.fixture(scope="module")
def dataset_uri(s3_server):
    uri = s3_server.bucket_uri("ids")
    bucket = uri[len("s3://") :].split("/")[0]
    fs = pafs.S3FileSystem(endpoint_override=s3_server.endpoint, scheme="http")
    for i in range(N):
        with fs.open_output_stream(f"{bucket}/ids/{i:04d}.txt") as out:
            out.write(str(i).encode())
    return uri


def train_fn(rank: int, world: int, config: dict) -> None:
    ray.init(address=config["address"], log_to_driver=False, configure_logging=False)
    ds = FileDataset(config["uri"], decode=int, seed=11, cache=CacheConfig(directory=config["cache"]))
    loader = DataLoader(ds, BATCH, num_workers=config["workers"], collate_fn=list)
    out = Path(config["out"])
    if config["resume"]:
        loader.load_state_dict(json.loads((out / "state.json").read_text()))
    seen = []
    for step, batch in enumerate(loader):
        seen.extend(batch)
        if step + 1 == config["stop_after"]:
            if rank == 0:  # the state is global: any one rank saves it
                (out / "state.json").write_text(json.dumps(loader.state_dict()))
            break
    (out / f"{config['tag']}-{rank}.json").write_text(json.dumps(seen))


def _fit(tmp_path: Path, world: int, **config) -> None:
    run_world(
        train_fn,
        world,
        {
            "out": str(tmp_path),
            "cache": str(tmp_path / "cache"),
            "address": ray.get_runtime_context().gcs_address,
            **config,
        },
        timeout_s=180,
    )


def _seen(tmp_path: Path, tag: str, world: int) -> list[int]:
    return [i for r in range(world) for i in json.loads((tmp_path / f"{tag}-{r}.json").read_text())]


def test_resume_mid_epoch_on_more_and_fewer_workers(tmp_path, dataset_uri):
    common = {"uri": dataset_uri}
    _fit(tmp_path, 2, tag="first", workers=2, resume=False, stop_after=STEPS_BEFORE, **common)
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["epoch"] == 0 and state["consumed"] == STEPS_BEFORE * 2 * BATCH
    before = _seen(tmp_path, "first", 2)
    assert len(before) == len(set(before)) == state["consumed"]
    perm = FileDataset(dataset_uri, seed=11, cache=None).permutation(0).tolist()
    for world, workers in ((3, 0), (1, 2)):
        tag = f"after{world}"
        _fit(tmp_path, world, tag=tag, workers=workers, resume=True, stop_after=-1, **common)
        union = before + _seen(tmp_path, tag, world)
        end = part.epoch_end(N, state["consumed"], world, BATCH)
        assert len(union) == len(set(union)), f"a sample repeated after resume on {world}"
        assert sorted(union) == sorted(perm[:end]), f"samples skipped after resume on {world}"
        assert N - len(union) < world * BATCH
