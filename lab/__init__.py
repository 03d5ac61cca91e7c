"""The quality lab: a real-text target made here, drafters of every architecture trained against it, one table (docs/quality.md)."""
