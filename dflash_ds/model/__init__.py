"""The drafter and its training objective: pure PyTorch, no distributed code."""
