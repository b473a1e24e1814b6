"""Optimisation models of the planner — intra-op SBP ILP, inter-op stage DP, cross-mesh
resharding (CP-SAT interval scheduling) and the heuristic searches kept beside them as
baselines and fallbacks. Pure Python over plain data: nothing here imports torch."""
