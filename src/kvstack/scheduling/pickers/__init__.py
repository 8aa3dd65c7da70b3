"""Pickers: each orders the scored candidates; the first is the target, the rest retry fallbacks."""
