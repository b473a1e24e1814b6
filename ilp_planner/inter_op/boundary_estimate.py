"""The stage DP's boundary cost: the cross-mesh time of every tensor crossing a cut,
estimated with the stage's batch-split layout on both sides (the final plan re-plans every
crossing tensor with its real layouts, :mod:`ilp_planner.inter_op.stage_resharding`). A
skip edge crossing several cuts is charged at each cut it crosses in the DP (as if
relayed), and sent once, directly, in the plan."""

from __future__ import annotations

import time

from ilp_planner.inputs.config import Config
from ilp_planner.inter_op.resharding import ReshardOptions, plan_resharding, with_scheduler
from ilp_planner.ir.cluster import SubMesh
from ilp_planner.ir.graph import Graph, TensorSpec


class BoundaryCost:
    """Cross-mesh seconds of every tensor crossing a cut, estimated during the DP with
    batch-split layouts on both sides and the cheap schedulers."""

    def __init__(self, config: Config, graph: Graph, units: list[list[str]]):
        self.config = config
        self.graph = graph
        self.units = units
        self.cache: dict[tuple, float] = {}
        self.options = with_scheduler(ReshardOptions(compare_strategies=False),
                                      algorithms=("load_balance", "randomized_greedy"))
        # tensors crossing each cut, in graph edge order, from one pass
        unit_of = {n: j for j, u in enumerate(units) for n in u}
        cuts: list[dict[str, None]] = [{} for _ in range(len(units) + 1)]
        for src, dst in graph.edges():
            if src in unit_of and dst in unit_of:
                for cut in range(unit_of[src] + 1, unit_of[dst] + 1):
                    cuts[cut][src] = None
        self.crossing = [list(c) for c in cuts]
        self.seconds = 0.0

    def __call__(self, end: int, shape: tuple[int, int]) -> float:
        t0 = time.perf_counter()
        out = sum(self.tensor_time(self.graph[s].output, shape) for s in self.crossing[end])
        self.seconds += time.perf_counter() - t0
        return out

    def tensor_time(self, tensor: TensorSpec, shape: tuple[int, int]) -> float:
        key = (tensor, shape)
        if key not in self.cache:
            cluster = self.config.cluster
            n, d = shape
            dpn = cluster.devices_per_node
            src = SubMesh(0, n, 0, d, dpn)
            if n == 1 and 2 * d <= dpn:
                dst = SubMesh(0, 1, d, d, dpn)
            elif cluster.nodes >= 2 * n:
                dst = SubMesh(n, n, 0, d, dpn)
            else:
                dst = SubMesh(n, max(1, cluster.nodes - n), 0, d, dpn) if cluster.nodes > n else None
            if dst is None:
                self.cache[key] = 0.0
            else:
                spec = _estimate_spec(tensor, src, dst)
                self.cache[key] = plan_resharding(tensor, src, spec, dst, spec, cluster,
                                                  self.options).makespan_s
        return self.cache[key]


def _estimate_spec(tensor: TensorSpec, src: SubMesh, dst: SubMesh) -> str:
    rest = "R" * (tensor.rank - 1)
    for spec, deg in (("S^{01}", src.size), ("S^0", src.nodes)):
        if tensor.shape[0] % max(deg, 1) == 0 and tensor.shape[0] % max(dst.size, 1) == 0:
            return spec + rest
    return "R" + rest
