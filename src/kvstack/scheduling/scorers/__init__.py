"""Scorers: each rates every candidate in [0, 1], higher is better. One module per scorer."""
