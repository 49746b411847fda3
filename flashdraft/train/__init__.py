"""Drafter training: prompt sets and target-regenerated data, objective, loop, export."""
