"""Conversations -> training rows: sources, chat masks, preparation (cache + audit), packing,
regeneration of responses by the target."""
