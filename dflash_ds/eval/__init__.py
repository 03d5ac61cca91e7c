"""Acceptance length tau: the exact offline measurement, the target's side of it, the reference
speculative-decoding loop and the CLI."""
