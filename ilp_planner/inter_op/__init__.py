"""Inter-op planning: layer units, stage solves, the stage DP, pipeline assembly and cross-mesh resharding."""
