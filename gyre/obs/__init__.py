"""Observability: pictures and summaries of what a gyre run did over time."""
