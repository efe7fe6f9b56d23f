"""Per-node service actors: checkpoint uploader and data cache."""
