"""IR: layer graph, cluster and meshes, SBP layouts, tensor regions — torch-free values."""
