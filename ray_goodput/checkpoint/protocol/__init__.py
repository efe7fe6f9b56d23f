"""The storage protocol: what a checkpoint is in storage and the rules for writing it.

``_layout`` names every object; ``_dcp_parts`` writes a rank's DCP files and merges their
metadata; ``_manifest`` and ``_commit`` make a save visible (rank markers, then
``COMMITTED`` written last); ``_lineage`` orders saves across attempts (generations, the
resume pin); ``_catalog`` finds and verifies commits; ``_retention`` deletes what no live
save needs. ``_collective`` makes every rank reach the same outcome. The design page
``docs/design/storage-layout.md`` is the contract these modules implement.
"""
