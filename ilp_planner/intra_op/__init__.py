"""Intra-op planning on one mesh: the problem build, the exact solve, realising a choice into a
plan, baselines."""
