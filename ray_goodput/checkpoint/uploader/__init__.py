"""The node's uploader service: snapshots in, committed checkpoints out.

``_actor`` is the ``CheckpointUploader`` actor (one per node, outliving worker-group
restarts), and ``_calls`` what the driver and the CLI ask of it (start one, its status,
wait for a dead attempt's saves); ``_client`` (``ActorBackend``) is a worker's side of it, over the socket of
``_channel``; ``_thread_backend`` runs the same jobs in the worker itself. Each rank's jobs
queue in a ``_rank_queue`` (one running, at most one waiting); ``_shard_job`` turns one
snapshot into DCP files, uploads them (``_follow_upload`` streams the data file while it is
written) and commits through ``checkpoint.protocol``.
"""
