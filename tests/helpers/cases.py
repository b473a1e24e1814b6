"""Config overrides that more than one test module solves."""

from __future__ import annotations

GRID_WINS = {"cluster.nodes": 2, "cluster.devices_per_node": 2, "cluster.memory_gib": 0.00064,
             "pipeline.stages": "auto", "pipeline.microbatches": 4, "pipeline.schedule": "1f1b"}
"""tiny-gpt-cpu as a memory-bound pipeline whose stage-DP optimum simulates slower than the
torchtitan grid's two stages: the plan is the grid's pipeline (the planner keeps it)."""
