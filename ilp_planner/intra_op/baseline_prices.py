"""The baselines priced beside a plan, under the same cost model: the usual hand-written
layouts (:func:`~ilp_planner.intra_op.baselines.price_families`) and the torchtitan-style
grid (:func:`~ilp_planner.intra_op.baselines.torchtitan_choice`), each as the cost
breakdown of its choice realised (:func:`realise`).

Each member is built restricted to its own strategies (:class:`MemberBuilder`): a few per
op instead of the hundreds the plan's space holds at scale, so pricing every family costs a
fraction of the plan's own solve."""

from __future__ import annotations

from ilp_planner.intra_op.baselines import (
    Filter,
    GridPoint,
    price_families,
    torchtitan_choice,
)
from ilp_planner.intra_op.moe_baselines import has_moe
from ilp_planner.intra_op.problem import (
    BuildCache,
    NodeCosts,
    SubsetNodes,
    build_nodes,
    problem_key,
    subset_nodes,
)
from ilp_planner.intra_op.realise import EdgeMemo, realise
from ilp_planner.intra_op.request import MeshSolveRequest
from ilp_planner.ir.graph import Graph


class MemberBuilder:
    """Builds a baseline member's restricted problem for a request's graph and mesh (the
    :data:`~ilp_planner.intra_op.baselines.Build` the families call), sharing one build
    cache per micro-batch count.

    Where the configured micro-batches' batch does not split over a member's data-parallel
    degree (GPT-175B's 16 sequences a micro-batch on 128 × 8 devices), the member runs as
    its engine would — fewer, larger micro-batches: the largest count below the configured
    one whose batch that degree divides (Megatron's ``global batch / (dp × micro-batch
    size)`` accumulation steps). Only for configs with a ``model.batch`` and no stage
    boundary; the member's name states the count. ``solver.max_weight_replication`` caps
    the planner's search, not a hand-written layout: members are built without it.

    On the configured micro-batches the members build in the request's own cache where it
    has one — the plan's: every option a member keeps is one the plan's build priced
    (:class:`~ilp_planner.intra_op.problem.BuildCache`'s ``base_options``), so a member
    builds only its edge matrices and the strategies the plan's space left out. Where the
    cache holds the plan's whole problem at the member's state sharding levels and
    recomputed blocks (the plan's own, uncapped: data parallel, Megatron, SUMMA and the
    grid's DDP points at the plan's levels — without checkpointing, or with the blocks the
    plan recomputes) and the graph has no couplings, the member is read off it
    (:func:`~ilp_planner.intra_op.problem.subset_nodes`): its rows and matrices indexed,
    nothing built. Its bound then holds the edges inside groups too, so the members of a
    family may be solved in another order; the best member and its price are the same."""

    def __init__(self, request: MeshSolveRequest):
        self.request = request
        self.caches: dict[int, BuildCache] = (
            {} if request.cache is None else {request.microbatches: request.cache})
        self.graphs: dict[int, Graph] = {request.microbatches: request.graph}

    def __call__(self, levels: tuple[int, ...], blocks: frozenset, keep: Filter,
                 dp: int) -> NodeCosts | SubsetNodes:
        m = self.request.microbatches
        try:
            return self._build(m, levels, blocks, keep)
        except ValueError as exc:
            other = self._fewer_microbatches(dp)
            if other is None:
                batch = self.request.config.model.get("batch")
                if isinstance(batch, int) and batch % dp:
                    raise ValueError(f"{exc}; no micro-batch count helps: the batch of {batch} "
                                     f"does not split over a data-parallel degree of {dp}") from None
                raise
            try:
                return self._build(other, levels, blocks, keep)
            except ValueError:
                raise exc from None

    def serves(self, request: MeshSolveRequest) -> bool:
        """Whether ``request`` asks what this builder's does (the same config object, mesh,
        budget and micro-batches, whole model)."""
        mine = self.request
        return (request.config is mine.config and request.boundary is None
                and mine.boundary is None
                and (request.nodes, request.local, request.memory_budget, request.microbatches)
                == (mine.nodes, mine.local, mine.memory_budget, mine.microbatches))

    def _fewer_microbatches(self, dp: int) -> int | None:
        """The largest micro-batch count below the configured one whose batch ``dp``
        divides (None: no such count, or the request cannot be re-batched)."""
        config, req = self.request.config, self.request
        batch = config.model.get("batch") if isinstance(config.model, dict) else None
        if not isinstance(batch, int) or req.boundary is not None or \
                req.microbatches != config.pipeline.microbatches:
            return None
        return next((m for m in range(req.microbatches - 1, 0, -1)
                     if batch % m == 0 and (batch // m) % dp == 0), None)

    def _build(self, m: int, levels: tuple[int, ...], blocks: frozenset,
               keep: Filter) -> NodeCosts | SubsetNodes:
        req, config = self.request, self.request.config
        if m not in self.graphs:
            self.graphs[m] = config.with_overrides({"pipeline.microbatches": m}).microbatch_graph()
        cache = self.caches.setdefault(m, BuildCache())
        whole = None if cache.problems_of is not self.graphs[m] else cache.problems.get(
            problem_key(config.cluster, req.nodes, req.local, config.memory,
                        config.solver.tie_layers, None, m, req.boundary,
                        config.grad_bucket_bytes, levels, blocks))
        subset = None if whole is None else subset_nodes(
            whole, keep, cache, config.solver.tie_layers, req.memory_budget)
        if subset is not None:
            return subset
        return build_nodes(self.graphs[m], config.cluster, req.nodes, req.local, config.memory,
                           tie_layers=config.solver.tie_layers,
                           memory_budget=req.memory_budget, microbatches=m,
                           boundary=req.boundary, grad_bucket_bytes=config.grad_bucket_bytes,
                           cache=cache, zero_levels=levels,
                           recompute=blocks, keep=keep)


_LAST: list[MemberBuilder] = []
"""The last request's builder: the torchtitan grid and the families priced for one solve
(two calls, :func:`grid_baseline` then :func:`price_baselines`) share its strategy lists and
options; one is kept, so a later solve frees it."""


def member_builder(request: MeshSolveRequest) -> MemberBuilder:
    """The builder for ``request``: the last one where it serves the same question."""
    if _LAST and _LAST[0].serves(request):
        return _LAST[0]
    _LAST[:] = [MemberBuilder(request)]
    return _LAST[0]


def price_baselines(request: MeshSolveRequest) -> dict[str, dict]:
    """The usual baselines (:func:`~ilp_planner.intra_op.baselines.price_families`: no state
    sharding, no recomputation) on the request's graph and mesh under its budget, each as
    its cost block or an error saying why it has none."""
    config = request.config
    out: dict[str, dict] = {}
    memo: EdgeMemo = {}  # the families' edges repeat per layer and across families
    for name, priced in price_families(member_builder(request), request.nodes, request.local,
                                       request.microbatches, request.memory_budget,
                                       config.solver.time_limit_s,
                                       moe=has_moe(request.graph)).items():
        out[name] = ({"error": priced} if isinstance(priced, str)
                     else realise(priced.gp, priced.choice, memo=memo)[1].to_dict())
    return out


def grid_baseline(request: MeshSolveRequest) -> GridPoint | str:
    """The torchtitan-style grid (:func:`~ilp_planner.intra_op.baselines.torchtitan_choice`) on
    the request's graph and mesh under its budget."""
    return torchtitan_choice(request.graph, member_builder(request), request.nodes,
                             request.local, request.memory_budget,
                             request.config.solver.time_limit_s, request.microbatches)


def price_grid(grid: GridPoint | str | None) -> dict[str, dict]:
    """The torchtitan-style baseline's cost block (or why it has none)."""
    if grid is None:
        return {}
    if isinstance(grid, str):
        return {"torchtitan": {"error": grid}}
    return {grid.name: realise(grid.gp, grid.choice, memo={})[1].to_dict()}  # layers' edges once

