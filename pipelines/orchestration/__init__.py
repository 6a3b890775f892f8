"""Orchestration: the stage DAG, its runners and the results table."""
