"""Data: datasets over any storage URI, a per-node cache, a resumable DataLoader.

    ds = FileDataset("s3://bucket/train/", decode=my_decode, seed=0)
    loader = DataLoader(ds, batch_size=32, num_workers=4)
    loader.load_state_dict(saved)            # optional: exact resume, any world size
    for batch in loader: ...; saved = loader.state_dict()
"""

from ray_goodput.data._cache_actor import cache_status
from ray_goodput.data._config import CacheConfig
from ray_goodput.data._datasets import CachedDataset, FileDataset
from ray_goodput.errors import CacheFullError, DataError
from ray_goodput.data._loader import DataLoader
from ray_goodput.data._parquet import ParquetDataset

__all__ = [
    "CacheConfig",
    "CacheFullError",
    "CachedDataset",
    "DataError",
    "DataLoader",
    "FileDataset",
    "ParquetDataset",
    "cache_status",
]
