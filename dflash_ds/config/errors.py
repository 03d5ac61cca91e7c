"""The one error a user's recipe can raise before launch."""

from __future__ import annotations


class RecipeError(ValueError):
    """A mistake in the recipe or its overrides; the message names the setting and the fix."""
