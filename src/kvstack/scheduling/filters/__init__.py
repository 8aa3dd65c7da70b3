"""Filters: each keeps the candidates that may serve a request. One module per filter."""
