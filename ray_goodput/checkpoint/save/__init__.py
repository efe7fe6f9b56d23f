"""The worker side of a save: what ``Checkpointer.save`` does before it returns.

``_snapshot`` (``Snapshotter.hand_off``) runs it top-down: ``_state_dict`` turns the user's
``state`` into DCP's flat state dict; ``protocol._shard_plan`` picks the rank's share;
``_arena_pair`` copies it into one of the rank's two snapshot arenas (``_arena``; their
files' names, claims, marks and sweeps across processes are ``_arena_files``;
``_first_save`` sizes the first one ahead of time); ``_handoff`` is what the rank gives the
uploader and gets back. ``_save_state`` names the states of a save's life. ``_schedule``,
``_ray_report`` and ``_local_copies`` are what the facade does around a save.
"""
