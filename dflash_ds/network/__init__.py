"""The drafter network: its shape, layers, attention masks and the target's two frozen matrices around
it (DraftModel), and the registry the architectures fill. Pure PyTorch, no distributed code."""
