"""Data: datasets over any storage URI, a per-node cache, a resumable DataLoader.

    ds = FileDataset("s3://bucket/train/", decode=my_decode, seed=0)
    loader = DataLoader(ds, batch_size=32, num_workers=4)
    loader.load_state_dict(saved)            # optional: exact resume, any world size
    for batch in loader: ...; saved = loader.state_dict()

The names load on first use (PEP 562): the node cache actor, which imports this package
for its own module, never needs the loader and so does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ray_goodput._lazy import lazy_exports

# public name -> module that defines it
_EXPORTS = {
    "CacheConfig": "ray_goodput.data._config",
    "CacheFullError": "ray_goodput.errors",
    "CachedDataset": "ray_goodput.data._datasets",
    "DataError": "ray_goodput.errors",
    "DataLoader": "ray_goodput.data._loader",
    "FileDataset": "ray_goodput.data._datasets",
    "ParquetDataset": "ray_goodput.data._parquet",
    "cache_status": "ray_goodput.data._cache_actor",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:
    from ray_goodput.data._cache_actor import cache_status
    from ray_goodput.data._config import CacheConfig
    from ray_goodput.data._datasets import CachedDataset, FileDataset
    from ray_goodput.data._loader import DataLoader
    from ray_goodput.data._parquet import ParquetDataset
    from ray_goodput.errors import CacheFullError, DataError
