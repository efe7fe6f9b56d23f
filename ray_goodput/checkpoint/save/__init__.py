"""The worker side of a save: what ``Checkpointer.save`` does before it returns.

``_state_dict`` turns the user's ``state`` into a DCP state dict; ``_arena_pair`` copies the
rank's tensors into one of its two snapshot arenas (``_arena``; ``_first_save`` sizes the
first one ahead of time); ``_handoff`` is what the rank gives the uploader and gets back;
``_save_state`` names the states of a save's life. ``_schedule``, ``_ray_report`` and
``_local_copies`` are what the facade does around a save.
"""
