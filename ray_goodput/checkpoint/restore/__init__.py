"""Restore: choosing the checkpoint to resume from and loading it into live objects.

``_load`` is the entry point (choose, verify, load, fall back); ``_reader`` is the DCP
``StorageReader`` it loads through, over ``_tiered_fs`` (node-local copy first, then storage
through ``_storage_fetch``, checked against the manifest). ``_prefetch`` and
``_local_precheck`` start reading a rank's own files while rank 0 still chooses;
``_direct_read``, ``_mmap`` and ``_byte_ranges`` put bytes straight into live tensors.
``_export`` writes a committed checkpoint as one ``torch.save`` file.
"""
