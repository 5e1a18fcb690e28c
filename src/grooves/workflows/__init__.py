"""Workflows on top of training runs: review, guard suggestions, probe runs, evals and drift."""
