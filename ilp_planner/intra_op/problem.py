"""The intra-op sharding problem as solver-independent data, built from a layer graph.

A :class:`Problem` has *groups* (ILP nodes) with one cost and one memory figure per
strategy, and *edges* with a resharding cost matrix ``R[k, l]``. The objective of a choice
``c`` (one strategy index per group) is::

    Σ_g cost_g[c_g]  +  Σ_(u,v) R_uv[c_u, c_v]  +  Σ_j α_j ⌈Σ_g bytes_g[c_g, j] / cap⌉
                                                      subject to  Σ_g mem_g[c_g] ≤ M

The last term prices the runtime's fused gradient buckets (:class:`BucketTerms`,
:mod:`ilp_planner.lowering.grad_buckets`): the gradients reduced over device group j are one flat
buffer reduced in ⌈bytes/cap⌉ equal chunks, so each chunk's latency ``α_j`` is paid once
however many ops fill it, while the bandwidth part stays in each op's own cost.

Building it from a graph (:func:`build_problem`) does the two reductions the ILP needs:

* **merging followers** — an elementwise op, pooling, flatten or the loss with one input
  can only follow its producer, so it joins the producer's node: option k of the node is a
  producer strategy and, for a follower reading partial sums, how they are reduced
  (reduce-scattered or all-reduced, :func:`ilp_planner.lowering.strategies.follower_inputs`);
  it fixes the followers' layouts and adds their costs;
* **tying repeated layers** (AutoDDL §4.5.1) — the same op of every repetition of a block
  shares one group; costs, memory and edge matrices of the copies are summed.

Graph inputs are free: data is loaded directly in whatever layout its consumer asks for.
An imported graph's functional code (``attrs.functional``) adds what ``parallelize`` can
run as couplings: the readers of one shared value take one layout and its program is priced
once (:mod:`ilp_planner.lowering.shared_reads`), and nothing moves between two pieces of
functional code (:func:`_add_shared_couplings`).
A pipeline stage's graph (``boundary``) also has *imported* inputs — tensors from an earlier
stage, whose gradients go back — and *exported* ops read by a later stage; the programs the
stage runs for them (:mod:`ilp_planner.lowering.stage_boundary`) are part of its costs.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from formulations.problem import BucketTerms, Problem
from ilp_planner.errors import InfeasibleError, UnprovenInfeasible
from ilp_planner.ir.cluster import Cluster, Factorisation
from ilp_planner.ir.graph import (
    Graph,
    Op,
    OpKind,
    TensorSpec,
    position_tables,
    read_inside_its_module,
)
from ilp_planner.ir.layouts import Layout, LayoutError, drop_unit_axes, grad_layout
from ilp_planner.lowering.compute_model import (
    PhaseWork,
    master_weight_seconds,
    phase_seconds,
    shard_cast_seconds,
    state_shard_seconds,
    unscale_seconds,
    update_seconds,
)
from ilp_planner.lowering.cost_model import (
    ONCE_PER_STEP,
    Collective,
    MemorySpec,
    collective_seconds,
    dominant_memory_term,
)
from ilp_planner.lowering.grad_buckets import buffer_key
from ilp_planner.lowering.redistribution import plan_redistribution, planner_for
from ilp_planner.lowering.shared_reads import riders
from ilp_planner.lowering.stage_boundary import StageBoundary, export_program, import_program
from ilp_planner.lowering.strategies import (
    FOLLOWER_KINDS,
    Strategy,
    StrategyContext,
    SyncBucket,
    backward_reads,
    follow,
    follower_held_bytes,
    follower_inputs,
    grad_sync,
    is_summa,
    op_strategies,
    param_layouts,
    param_shapes,
    replay_seconds,
    tie_transposes,
    tied_exchange_seconds,
    tied_source,
    with_state_sharding,
)

StrategyFilter = Callable[[Op, Strategy], bool]
"""Which of an op's strategies a restricted build keeps (a baseline's layouts)."""


_FACTORED = (OpKind.LINEAR, OpKind.EMBEDDING, OpKind.MATMUL, OpKind.CONV2D)


@dataclass(frozen=True)
class Restriction:
    """A :data:`StrategyFilter` that also names the only mesh factorisations it can pass for
    a matmul, embedding or convolution, so a restricted build tests only those strategies
    against it (hundreds of others on 1,024 devices, the same for every member)."""

    keep: StrategyFilter
    matmul_facts: frozenset

    def __call__(self, op: Op, s: Strategy) -> bool:
        return self.keep(op, s)


@dataclass
class NodeOption:
    """Strategy k of an ILP node: the base strategy plus what its followers do. Per-op
    lists are indexed by the op's position in the node (0 = the base op), so tied nodes of
    different blocks can share one option list."""

    base: Strategy
    outputs: list[Layout]
    inputs: list[tuple[Layout, ...]]
    grads: list[tuple[Layout, ...]]  # the layout each input's gradient leaves the op in
    collectives: list[list[Collective]]  # intra-op collectives, a follower's resolve included
    compute_s: list[float]
    cost_s: float  # per step: microbatches × (compute + activation comm) + grad sync
    memory_bytes: float
    state_bytes: float
    activation_bytes: float  # of one micro-batch
    syncs: tuple[SyncBucket, ...] = ()  # the base op's gradient reductions (priced in cost_s)
    recompute: bool = False  # activations dropped after forward, recomputed in backward
    recompute_bytes: float = 0.0  # those activations, re-materialised in the block's backward
    transient_bytes: float = 0.0  # held while the node runs (state sharding)
    # per op, what a recomputation runs again (:attr:`Strategy.replay_s`)
    replay_s: list[float] = field(default_factory=list)
    # ZeRO-3, per micro-batch: what a recomputation changes in the shards' casts — each
    # bucket's recomputation gather casts its shard (a replayed kernel) and the backward
    # gathers none (:func:`~ilp_planner.lowering.compute_model.shard_cast_seconds`)
    recompute_cast_s: float = 0.0


@dataclass
class GraphProblem:
    """A :class:`Problem` together with what maps its solution back to the graph."""

    problem: Problem
    graph: Graph
    ctx: StrategyContext
    owner: dict[str, str]  # op -> node (representative op); inputs map to themselves
    position: dict[str, int]  # op -> index within its node
    members: dict[str, list[str]]  # node -> ops in it (representative first)
    options: dict[str, list[NodeOption]]  # node -> options
    group_of: dict[str, int]  # node -> group index
    groups: list[list[str]] = field(default_factory=list)  # group -> nodes
    microbatches: int = 1
    boundary: StageBoundary = field(default_factory=StageBoundary)
    grad_bucket_bytes: float = 0.0  # the runtime's gradient bucket cap (grad_buckets)
    recomputed: frozenset[str] = frozenset()  # nodes whose activations are recomputed
    recompute_units: frozenset[tuple[str, int]] = frozenset()  # the blocks asked for

    def node_choice(self, choice: np.ndarray | list[int]) -> dict[str, NodeOption]:
        return {node: self.options[node][int(choice[g])] for node, g in self.group_of.items()}

    def unrunnable(self, choice: np.ndarray | list[int]) -> str | None:
        """Why ``parallelize`` could not run ``choice`` (the couplings of
        :func:`_add_shared_couplings` it breaks: a choice that does costs more than the
        objective of any that does not), or None."""
        chosen = self.node_choice(choice)

        def read(name: str, idx: int) -> tuple[Layout, Layout]:
            opt, pos = chosen[self.owner[name]], self.position[name]
            return opt.inputs[pos][idx], opt.grads[pos][idx]

        for (o, oi), (d, di) in riders(self.graph).items():
            # an unused reader hands back no gradient: its input layout alone must agree
            n = 1 if self.graph[o].unused or self.graph[d].unused else 2
            if tuple(map(drop_unit_axes, read(o, oi)[:n])) \
                    != tuple(map(drop_unit_axes, read(d, di)[:n])):
                return (f"{self.graph[o].inputs[oi]!r} feeds functional code in two layouts "
                        f"({d!r}, {o!r}): no module boundary can run both programs")
        pairs = [(src, dst) for src, dst in self.graph.edges()
                 if self.graph[src].kind is not OpKind.INPUT and self.owner[src] != self.owner[dst]]
        for i in sorted(_functional_edges(self.graph, pairs)):
            src, dst = pairs[i]
            out = chosen[self.owner[src]].outputs[self.position[src]]
            if not _as_produced(out, *read(dst, self.graph[dst].inputs.index(src))):
                return (f"the layout of {src!r} changes between two pieces of functional code "
                        f"(before {dst!r}), where no module boundary runs a program")
        for src, reads in input_reads(self.graph, self.boundary).items():
            seen = {drop_unit_axes(read(c, i)[0]) for c, i in reads}
            if len(seen) > 1:
                return (f"input {src!r} is read in {len(seen)} layouts "
                        f"({', '.join(sorted(map(str, seen)))}): the module is handed one "
                        f"tensor per input")
        for node, ps, pf in _functional_follows(self.graph, self.owner, self.position):
            opt = chosen[node]
            if not _as_produced(opt.outputs[ps], opt.inputs[pf][0], opt.grads[pf][0]):
                src, dst = self.members[node][ps], self.members[node][pf]
                return (f"the layout of {src!r} changes between two pieces of functional code "
                        f"(before {dst!r}, which follows it), where no module boundary runs a "
                        f"program")
        return None

    def refuse_unrunnable(self, choice: np.ndarray | list[int], what: str,
                          proven: bool = True) -> None:
        """Raise :class:`InfeasibleError` where ``choice`` breaks a coupling
        (:meth:`unrunnable`). The couplings are penalties, not constraints: a solve stopped
        short (time limit, heuristic fallback) or a restricted problem in which every
        choice breaks one can return such a choice, which must never become a plan or a
        price. ``what`` names the choice (``"the solver's choice"``); ``proven``: it is an
        optimum, so every choice breaks one — else :class:`UnprovenInfeasible`."""
        broken = self.unrunnable(choice)
        if broken is not None:
            raise (InfeasibleError if proven else UnprovenInfeasible)(
                f"the runtime cannot run {what}: {broken}")


@dataclass
class BuildCache:
    """What :func:`build_problem` derives per distinct op and edge, kept across the builds
    of graphs cut from one model (a pipeline's stage ranges on their sub-meshes). Node
    options, edge matrices and boundary programs are pure functions of the ops' content
    (names aside), the mesh and the micro-batch count, so a later build reuses them as
    they are — the same arrays, bit for bit. The cache holds every options list it keys
    matrices by, so their ids stay valid."""

    options: dict[tuple, list[NodeOption]] = field(default_factory=dict)
    matrices: dict[tuple, np.ndarray] = field(default_factory=dict)
    programs: dict[tuple, float] = field(default_factory=dict)
    facts: dict[int, _ListFacts] = field(default_factory=dict)
    recomputed: dict[tuple, tuple] = field(default_factory=dict)
    # whole problems of one graph (``problems_of``) by their build arguments save the
    # budget, for the rebuilds one solve repeats (:func:`ilp_planner.intra_op.solve_mesh._built`)
    problems: dict[tuple, GraphProblem] = field(default_factory=dict)
    problems_of: Graph | None = None
    # every strategy of an op (by content, inputs and context): the plan's build and the
    # restricted builds (``keep``) that each keep a few of them (:func:`_every_strategy`)
    strategies: dict[tuple, list[Strategy]] = field(default_factory=dict)
    # a node's options for one base strategy (by the node's content and the mesh's cost
    # context, then the strategy's value): shared by every build that offers that
    # strategy — the plan's full build and each baseline member's restricted one
    # (:func:`_node_options`)
    base_options: dict[tuple, dict[Strategy, list[NodeOption]]] = field(default_factory=dict)
    # a recomputed option (``recomputed``) by (id of the option, micro-batches, copies); each
    # entry keeps its source option alive so the id stays valid
    recomputed_options: dict[tuple, tuple[NodeOption, NodeOption]] = field(default_factory=dict)
    # an edge's program seconds between its distinct layouts (:func:`_cost_matrix`'s small
    # matrix) by (cluster, tensor, producer layouts, consumer layouts, replay): the members
    # whose options differ but whose layouts on an edge agree read one matrix
    layout_matrices: dict[tuple, np.ndarray] = field(default_factory=dict)
    # a graph's node structure (:class:`_Structure`) by (graph id, boundary, tie_layers),
    # the latest ``STRUCTURES_KEPT``; each entry holds its graph so the id stays valid
    structures: dict[tuple, _Structure] = field(default_factory=dict)


def _op_content(op: Op) -> tuple:
    """An op without its name and its inputs' names: what its strategies depend on."""
    return (op.kind, op.output, op.weight, op.params, op.flops, tuple(sorted(op.attrs.items())),
            len(op.inputs))


def gradient_merges(graph: Graph, name: str,
                    boundary: StageBoundary | None = None) -> tuple[int, ...]:
    """The reads of ``name`` (input indices) whose gradient autograd adds to one already
    produced for the same tensor: a tensor read k times gets k − 1 additions in the
    backward, each charged to a read after its first in graph order (a residual stream's
    add; the second operand of ``x + x``), and one more per read where a later stage also
    reads it (its gradient comes back from there: ``boundary.exported``). None for a
    tensor that takes no gradient (:meth:`~ilp_planner.ir.graph.Graph.gradient_carriers`:
    model data, integers, what is computed from data alone); a tensor imported from an
    earlier stage takes one (``boundary.imported``)."""
    op = graph[name]
    if op.unused:  # it hands no gradient back
        return ()
    imported = boundary.imported if boundary is not None else frozenset()
    exported = boundary.exported if boundary is not None else frozenset()
    carriers = graph.gradient_carriers(imported)
    out = []
    for i, src in enumerate(op.inputs):
        if src not in carriers:
            continue
        first = graph.consumers(src)[0]
        if src in exported or (first, graph[first].inputs.index(src)) != (name, i):
            out.append(i)
    return tuple(out)


def merge_seconds(graph: Graph, name: str, merges: tuple[int, ...],
                  layouts: tuple[Layout, ...], cluster: Cluster) -> float:
    """Backward seconds of ``name``'s ``merges`` (:func:`gradient_merges`) on one device:
    one addition a merge (read both gradients, write one: 3 × the local gradient's bytes, a
    kernel each), at its inputs' ``layouts``; 0 on a flat cluster."""
    device = cluster.device
    if not merges or device is None:
        return 0.0
    op = graph[name]
    moved = sum(3 * layouts[i].local_bytes(graph[op.inputs[i]].output) for i in merges)
    return phase_seconds(PhaseWork(0.0, moved, len(merges)), device,
                         graph[op.inputs[merges[0]]].output.dtype)


def _follower(op: Op, graph: Graph) -> bool:
    return (op.kind in FOLLOWER_KINDS and len(op.inputs) == 1
            and graph[op.inputs[0]].kind is not OpKind.INPUT)


def _per_step(compute_s: float, colls: list[Collective], microbatches: int) -> float:
    """Seconds per step: compute and activation collectives run once per micro-batch,
    weight-gradient synchronisation once per step (gradient accumulation)."""
    act = sum(c.seconds for c in colls if c.purpose not in ONCE_PER_STEP)
    grad = sum(c.seconds for c in colls if c.purpose in ONCE_PER_STEP)
    return microbatches * (compute_s + act) + grad


def _node_options(graph: Graph, node: str, members: list[str], ctx: StrategyContext,
                  microbatches: int, input_reached: bool,
                  keep: StrategyFilter | None = None,
                  cache: BuildCache | None = None, tied_table: bool = False,
                  rides: dict[tuple[str, int], tuple[str, int]] | None = None, *,
                  merges: tuple[tuple[int, ...], ...]) -> list[NodeOption]:
    """``rides``: :func:`riders` of ``graph`` (the structure's, derived here when not
    given); ``merges``: each member's :func:`gradient_merges` (the structure's, with its
    stage boundary)."""
    rep = graph[node]
    in_specs = [graph[i].output for i in rep.inputs]
    opts: list[NodeOption] = []
    readers = [f for f in members[1:] if graph[f].inputs[0] == node]  # may see partial sums
    rides = riders(graph) if rides is None else rides
    riding = frozenset(f for f in members[1:] if (f, 0) in rides)
    memo = None
    if cache is not None:  # by what an option depends on besides its base strategy
        memo = cache.base_options.setdefault((
            _cost_context(ctx), microbatches, input_reached, tuple(in_specs),
            tuple((*_op_content(graph[m]), members.index(graph[m].inputs[0]) if i else -1)
                  for i, m in enumerate(members)), merges), {})
    for base in _kept_strategies(rep, node, in_specs, ctx, keep, cache, tied_table):
        made = None if memo is None else memo.get(base)
        if made is None:
            choices = [follower_inputs(graph[f], base.output, rep.output) for f in readers]
            made = [_node_option(graph, members, base, dict(zip(readers, picks, strict=True)),
                                 ctx, microbatches, input_reached, riding, merges)
                    for picks in itertools.product(*choices)]
            if memo is not None:
                memo[base] = made
        opts.extend(made)
    if not opts:
        raise ValueError(
            f"op {node!r} ({rep.kind.value}, output {rep.output.shape}) has no strategy on a "
            f"{ctx.nodes}x{ctx.local} mesh (no factorisation divides its dimensions)"
        )
    return opts


def _cost_context(ctx: StrategyContext) -> StrategyContext:
    """``ctx`` without what only decides which strategies exist (the p0 cap, the state
    sharding levels offered, a restricted build's factorisations): a given strategy's
    option is priced the same under either, so the plan's build and the baseline members'
    share it."""
    if ctx.max_weight_replication is None and ctx.zero_levels == (0,) and ctx.facts is None:
        return ctx
    return dataclasses.replace(ctx, max_weight_replication=None, zero_levels=(0,), facts=None)


def _every_strategy(op: Op, in_specs: list[TensorSpec], ctx: StrategyContext,
                    cache: BuildCache | None,
                    facts: frozenset[Factorisation] | None = None) -> list[Strategy]:
    """:func:`op_strategies`, once per op content, inputs and context with ``cache`` (the
    plan's build and each baseline member's read one list); a context offering state
    sharding derives its list from the one without (:func:`with_state_sharding`), so the
    FSDP members do not derive the layouts the DDP members did. ``facts``: only the
    strategies on those factorisations (a :class:`Restriction`'s matmul ones) — the whole
    list's where the cache holds it, else enumerated on them alone (a member on a graph
    the plan never built: another micro-batch count's)."""
    if facts is not None:
        whole = None if cache is None else cache.strategies.get(
            (_op_content(op), tuple(in_specs), ctx))
        if whole is None:
            try:
                return _every_strategy(op, in_specs, dataclasses.replace(ctx, facts=facts),
                                       cache)
            except ValueError:  # the op refuses these factorisations (a fused linear none
                # splits evenly): its whole list says whether another serves, as before
                whole = _every_strategy(op, in_specs, ctx, cache)
        return [s for s in whole if s.fact in facts]
    if cache is None:
        return op_strategies(op, in_specs, ctx)
    key = (_op_content(op), tuple(in_specs), ctx)
    every = cache.strategies.get(key)
    if every is None and ctx.facts is not None and not any(ctx.zero_levels):
        whole = cache.strategies.get((_op_content(op), tuple(in_specs),
                                      dataclasses.replace(ctx, facts=None)))
        if whole is not None:  # the plan's list, on these factorisations
            every = cache.strategies[key] = [s for s in whole if s.fact in ctx.facts]
    if every is None:
        if any(ctx.zero_levels):
            plain = dataclasses.replace(ctx, zero_levels=(0,))
            every = with_state_sharding(op, _every_strategy(op, in_specs, plain, cache), ctx)
        else:
            every = op_strategies(op, in_specs, ctx)
        cache.strategies[key] = every
    return every


def _kept_strategies(op: Op, node: str, in_specs: list[TensorSpec], ctx: StrategyContext,
                     keep: StrategyFilter | None, cache: BuildCache | None,
                     tied_table: bool = False) -> list[Strategy]:
    """The op's strategies (:func:`op_strategies`), only those ``keep`` passes when given
    (an op nothing can shard keeps its replicated ones: any hand-written layout replicates
    it too; a tied table, whose two copies exchange whole gradients and so keep their
    state replicated, keeps the replicated twin of every layout ``keep`` passes at some
    state sharding level — FSDP's members included). Raises ``ValueError`` naming the op
    when ``keep`` passes none."""
    if keep is None:
        return _every_strategy(op, in_specs, ctx, cache)
    facts = keep.matmul_facts if isinstance(keep, Restriction) and op.kind in _FACTORED \
        else None
    offered = _every_strategy(op, in_specs, ctx, cache, facts)
    kept = [s for s in offered if (op.kind is OpKind.OPAQUE and not s.zero) or keep(op, s)]
    # a tied table's twins share their strategies' factorisations, so the member's list
    # serves them; a refusal names the op's whole list
    every = _every_strategy(op, in_specs, ctx, cache) if facts is not None and not kept \
        else offered
    if tied_table:  # its state stays replicated: layouts the restriction takes at any level
        def twin(s: Strategy) -> tuple:
            return s.label.split("+zero")[0], s.fact, s.inputs, s.weight, s.output

        layouts = {twin(s) for s in kept}
        kept = [s for s in every if not s.zero and twin(s) in layouts]
    if every and not kept:
        offered = sorted({str(drop_unit_axes(s.output)) for s in every})
        raise ValueError(f"no allowed strategy for {node} ({op.kind.value} {op.output.shape}): "
                         f"the baseline's layouts are not among the {len(offered)} output "
                         f"layouts this op can take on the mesh (e.g. {', '.join(offered[:3])})")
    return kept


def _node_option(graph: Graph, members: list[str], base: Strategy, resolved_for: dict[str, Layout],
                 ctx: StrategyContext, microbatches: int, input_reached: bool,
                 riding: frozenset[str], merges: tuple[tuple[int, ...], ...]) -> NodeOption:
    """One option: the base strategy, and each follower reading the base op's output in
    ``resolved_for[follower]`` (one of :func:`follower_inputs`). A follower in ``riding``
    reads a shared value whose program another follower of the node runs
    (:func:`~ilp_planner.lowering.shared_reads.riders`): its resolve is neither listed nor
    priced again (the runtime converts the value once). ``merges``: each member's
    :func:`gradient_merges`, from the structure."""
    rep = graph[members[0]]
    outputs = [base.output]
    inputs = [base.inputs]
    grads = [base.grads_of_inputs]
    own = list(base.collectives)
    if input_reached:  # autograd reaches the input
        own += base.input_backward
    colls = [own]
    # the optimizer step, once per step: spread over the micro-batches' compute, so that
    # the step counts it once (0 under the flat model, which never priced it)
    buckets = grad_sync(rep, base.label, base.inputs, base.weight, base.output, ctx)
    syncs = () if base.zero else buckets
    update = update_seconds(base.update_params, ctx.memory, rep, ctx.cluster)
    recompute_cast = 0.0  # ZeRO-3: what a recomputation changes in the gathers' casts
    if base.zero:  # the sharded buckets' passes (their gathers' casts, flat gradients)
        shards = [(len(b.roles), b.numel, b.collective.group_size,
                   backward_reads(rep, b.roles, input_reached)) for b in buckets]
        update += state_shard_seconds(rep, shards, base.zero, microbatches, ctx.cluster)
        if base.zero == 3:  # every bucket's gather replayed, none gathered by the backward
            recompute_cast = sum(shard_cast_seconds(rep, n, p, ctx.cluster, replayed=True)
                                 - (shard_cast_seconds(rep, n, p, ctx.cluster) if read else 0.0)
                                 for _, n, p, read in shards)
    update += _master_passes(rep, base, buckets, ctx, microbatches)
    comp = [base.compute_s + update / microbatches
            + merge_seconds(graph, members[0], merges[0], base.inputs, ctx.cluster)]
    replay = [base.replay_compute_s]
    cost = _per_step(comp[0], own, microbatches)
    act = base.activation_bytes
    for f in members[1:]:
        op = graph[f]
        src = op.inputs[0]
        tensor = graph[src].output
        raw = outputs[members.index(src)]
        resolved = resolved_for.get(f, raw)
        out, fc, secs = follow(op, tensor, resolved, ctx)
        fc = list(fc)
        again = replay_seconds(op, tensor, resolved, ctx)
        if resolved != raw and f not in riding:
            red = plan_redistribution(raw, resolved, tensor, ctx.cluster)
            fc = red.forward + red.backward + fc
            # its slices' copies, local work beside the collectives (a recomputation runs
            # the forward's again)
            secs += red.local_forward_s + red.local_backward_s
            again += red.local_forward_s
        secs += merge_seconds(graph, f, merges[members.index(f)], (resolved,), ctx.cluster)
        outputs.append(out)
        inputs.append((resolved,))
        grads.append((resolved,))
        colls.append(fc)
        comp.append(secs)
        replay.append(again)
        cost += _per_step(secs, fc, microbatches)
        act += follower_held_bytes(op, tensor, resolved, out)
    return NodeOption(base, outputs, inputs, grads, colls, comp, cost,
                      base.state_bytes + act, base.state_bytes, act, syncs,
                      transient_bytes=base.transient_bytes if input_reached else
                      # no input gradient: no backward gather held beside the full gradient
                      max(base.gathered_bytes, base.transient_bytes - base.regathered_bytes),
                      replay_s=replay, recompute_cast_s=recompute_cast)


def _master_passes(rep: Op, base: Strategy, buckets: tuple[SyncBucket, ...], ctx: StrategyContext,
                   microbatches: int) -> float:
    """The runtime's passes over ``rep``'s master weights that no sharded bucket runs
    (:func:`master_weight_seconds`), role by role: a role in a gradient bucket accumulates
    into its slice of the flat buffer every micro-batch; one outside every bucket (nothing
    to synchronise, or SUMMA's weight, which its gather's backward reduce-scatters) takes
    its first gradient as it comes. Under state sharding the buckets' roles run their own
    passes (:func:`state_shard_seconds`): only the others are priced here. SUMMA's weight
    block is cast at its gathered size in the strategy's compute, not here. Under float16,
    the loss scale's unscaling of every gradient the optimizer reads — a sharded bucket's
    shard, or a role's whole block (:func:`unscale_seconds`). None for a frozen op: no
    gradient, nothing to cast back or accumulate."""
    if rep.frozen:
        return 0.0
    lays = param_layouts(rep, base.label, base.inputs, base.weight, base.output)
    shapes = param_shapes(rep)
    bucketed = {r for b in buckets for r in b.roles}
    total = 0.0
    for synced in (False, True) if not base.zero else (False,):
        roles = [r for r in lays if (r in bucketed) == synced]
        local = {r: math.prod(lays[r][0].padded_shape(shapes[r])) for r in roles}
        gathered = local.get("weight", 0) if is_summa(base.label) else 0
        total += master_weight_seconds(rep, float(sum(local.values())), len(roles), ctx.memory,
                                       microbatches, synced, ctx.cluster, gathered)
    read = len(buckets) + sum(1 for r in lays if r not in bucketed) if base.zero else len(lays)
    return total + unscale_seconds(rep, base.update_params, read, ctx.cluster)


def recomputed(opt: NodeOption, microbatches: int, copies: int) -> NodeOption:
    """``opt`` with activation recomputation (:func:`torch.utils.checkpoint` over the
    node's block): its forward compute and forward activation collectives run again in the
    backward (listed again in phase ``recompute``; its forward compute is ``replay_s``, a
    third of the op's compute under the flat model, with checkpoint's host time where
    measured), and its outputs are not held between
    forward and backward. They are re-materialised while the block's backward runs, one
    block at a time: the memory row charges ``activation / copies`` (``copies`` = the
    blocks of this family), exact when the blocks are tied (the copies sum to one block),
    and :func:`peak_memory` gives the exact peak of any choice.

    ZeRO-3 (FSDP with checkpointing): the recomputation gathers the weights again and the
    op's backward reads that buffer — its own backward gather (listed where the input's
    gradient reads the weights, :func:`ilp_planner.lowering.strategies.state_sharded`) is dropped,
    two gathers per micro-batch instead of three. The kept buffer is held like a
    re-materialised activation, from the block's recomputation to the op's backward, so
    it joins ``recompute_bytes`` and leaves the op's transient. The gathers' casts move
    with them (``recompute_cast_s``): every bucket's shard is cast again by the
    recomputation — a bucket whose backward reads no weight too — and none by the
    backward."""
    def regather(c: Collective) -> bool:
        return c.purpose == "fsdp_gather" and c.phase == "backward"

    dropped = [c for cs in opt.collectives for c in cs if regather(c)]
    kept = [[c for c in cs if not regather(c)] for cs in opt.collectives]
    colls = [cs + [c.with_phase("recompute") for c in cs
                   if c.phase == "forward" and c.purpose not in ONCE_PER_STEP]
             for cs in kept]
    extra = [list(cs[len(orig):]) for cs, orig in zip(colls, kept, strict=True)]
    again = (sum(opt.replay_s) + opt.recompute_cast_s + sum(c.seconds for cs in extra for c in cs)
             - sum(c.seconds for c in dropped))
    reused = opt.base.regathered_bytes if dropped else 0.0  # the recomputation's gather
    rematerialised = opt.activation_bytes + reused
    charged = rematerialised / copies
    return dataclasses.replace(
        opt, collectives=colls, compute_s=[c + f + (opt.recompute_cast_s if i == 0 else 0.0)
                                           for i, (c, f) in enumerate(zip(
                                               opt.compute_s, opt.replay_s, strict=True))],
        cost_s=opt.cost_s + microbatches * again, memory_bytes=opt.state_bytes + charged,
        activation_bytes=charged, recompute=True, recompute_bytes=rematerialised,
        # max(forward gather, full gradient + regathered) without the regathered weights,
        # now in recompute_bytes: max(forward gather, full gradient)
        transient_bytes=max(opt.base.gathered_bytes, opt.transient_bytes - reused))


def build_problem(graph: Graph, cluster: Cluster, nodes: int, local: int, memory: MemorySpec,
                  *, tie_layers: bool = True, max_weight_replication: int | None = None,
                  memory_budget: float | None = None, microbatches: int = 1,
                  boundary: StageBoundary | None = None,
                  grad_bucket_bytes: float = 0.0, cache: BuildCache | None = None,
                  zero_levels: tuple[int, ...] = (0,),
                  recompute: frozenset[tuple[str, int]] = frozenset(),
                  keep: StrategyFilter | None = None) -> GraphProblem:
    """Build the problem for ``graph`` (one micro-batch) on an ``nodes × local`` mesh;
    costs are per step of ``microbatches`` accumulated micro-batches. ``boundary`` names
    the imported inputs and exported ops when ``graph`` is one pipeline stage.
    ``grad_bucket_bytes`` is the runtime's gradient bucket cap: above 0, gradient
    reductions are priced as fused buckets (:class:`BucketTerms`); 0 prices one AllReduce
    per op and set of partial axes. ``cache`` (:class:`BuildCache`) carries per-op work
    over to later builds of graphs cut from the same model. ``zero_levels`` are the state
    sharding levels offered per weighted op (:func:`ilp_planner.lowering.strategies.state_sharded`);
    ``recompute`` names the blocks ``(block, block_index)`` whose activations are
    recomputed (:func:`recomputed`; the ops of a block whose outputs leave it are kept).
    ``keep`` restricts every op to the strategies it passes (a baseline's): the problem is
    then the full one's :func:`~ilp_planner.intra_op.baselines.restrict` — the same costs,
    built without the strategies it would drop (``ValueError`` where an op keeps none).
    The build's two halves: :func:`build_nodes`, then :meth:`NodeCosts.complete`."""
    return build_nodes(graph, cluster, nodes, local, memory, tie_layers=tie_layers,
                       max_weight_replication=max_weight_replication,
                       memory_budget=memory_budget, microbatches=microbatches,
                       boundary=boundary, grad_bucket_bytes=grad_bucket_bytes, cache=cache,
                       zero_levels=zero_levels, recompute=recompute, keep=keep).complete()


def build_nodes(graph: Graph, cluster: Cluster, nodes: int, local: int, memory: MemorySpec,
                *, tie_layers: bool = True, max_weight_replication: int | None = None,
                memory_budget: float | None = None, microbatches: int = 1,
                boundary: StageBoundary | None = None,
                grad_bucket_bytes: float = 0.0, cache: BuildCache | None = None,
                zero_levels: tuple[int, ...] = (0,),
                recompute: frozenset[tuple[str, int]] = frozenset(),
                keep: StrategyFilter | None = None) -> NodeCosts:
    """:func:`build_problem`'s first half (its arguments): every node's options and the
    groups' cost and memory rows, no edge priced yet."""
    boundary = boundary or StageBoundary()
    ctx = StrategyContext(cluster, nodes, local, memory, max_weight_replication,
                          tuple(zero_levels))
    st = _structure(graph, boundary, tie_layers, cache)
    again = st.recomputed_nodes(frozenset(recompute))
    options = _options_per_node(graph, st, ctx, microbatches, again, cache, keep)
    derived: dict[int, _ListFacts] = {} if cache is None else cache.facts
    facts = functools.partial(_cached_facts, derived)
    cost = [np.zeros(len(options[g[0]])) for g in st.groups]
    mem = [np.zeros(len(options[g[0]])) for g in st.groups]
    uses = _list_uses(st, options)
    for (g, _), (opts, count) in uses.items():
        f = facts(opts)
        cost[g] += count * f.cost
        mem[g] += count * f.memory
        if boundary.inflight > 1:  # every micro-batch in flight holds its activations
            mem[g] += count * (boundary.inflight - 1) * f.held
    _add_boundary_programs(graph, cluster, boundary, st.owner, st.position, options,
                           st.group_of, cost, microbatches,
                           {} if cache is None else cache.programs)
    buckets = (_bucket_terms(uses, cost, grad_bucket_bytes, ctx, facts)
               if grad_bucket_bytes > 0 else None)
    return NodeCosts(cluster, ctx, st, options, again, microbatches, cost, mem, buckets,
                     memory_budget, grad_bucket_bytes, frozenset(recompute), cache)


ListUses = dict[tuple[int, int], tuple[list[NodeOption], int]]
"""Per (group, options list id): the list and how many of the group's nodes use it."""


def _list_uses(st: _Structure, options: dict[str, list[NodeOption]]) -> ListUses:
    """The options lists each group's nodes use, counted: a repeated layer's copies share
    one list, so a group's rows are sums over a few lists (a 32-layer GPT's 600 nodes, 20
    lists), each priced once."""
    uses: ListUses = {}
    for node, g in st.group_of.items():
        opts = options[node]
        key = (g, id(opts))
        hit = uses.get(key)
        uses[key] = (opts, 1 if hit is None else hit[1] + 1)
    return uses


@dataclass
class NodeCosts:
    """A build's first half (:func:`build_nodes`): every node's options and the groups'
    cost and memory rows (gradient latencies already moved into the bucket terms), before
    any edge is priced. The least memory a choice needs and a bound on the objective are
    known here; a baseline member that cannot fit, or whose bound already exceeds its
    family's best, is never completed — the edges are half of a build."""

    cluster: Cluster
    ctx: StrategyContext
    st: _Structure  # the graph and its boundary with them
    options: dict[str, list[NodeOption]]
    again: dict[str, int]
    microbatches: int
    cost: list[np.ndarray]
    mem: list[np.ndarray]
    buckets: BucketTerms | None
    memory_budget: float | None
    grad_bucket_bytes: float
    recompute: frozenset[tuple[str, int]]
    cache: BuildCache | None
    done: GraphProblem | None = None

    def min_memory(self) -> float:
        """The least per-device memory any choice needs (the edges hold none)."""
        return sum(float(m.min()) for m in self.mem)

    def bound(self) -> float:
        """A bound no choice goes below: every group's cheapest option on its own (edges,
        couplings and the fused gradient latencies only add to it)."""
        return float(sum(c.min() for c in self.cost))

    def complete(self) -> GraphProblem:
        """The whole problem (once): the edges' redistribution matrices, the tied tables'
        gradient exchange and the couplings added. The rows are completed in place, so
        read :meth:`bound` and :meth:`min_memory` before."""
        if self.done is None:
            st, options, cost = self.st, self.options, self.cost
            edges = _edge_costs(st, self.cluster, options, self.again, self.microbatches, cost,
                                self.cache)
            _add_tied_exchange(st.graph, self.cluster, st.owner, st.position, options,
                               st.group_of, edges)
            _add_shared_couplings(st, options, cost, edges, self.buckets)
            problem = Problem([st.group_key[g[0]] for g in st.groups], cost, self.mem, edges,
                              self.memory_budget, self.buckets)
            self.done = GraphProblem(
                problem, st.graph, self.ctx, st.owner, st.position, st.members, options,
                st.group_of, st.groups, self.microbatches, st.boundary,
                self.grad_bucket_bytes, frozenset(self.again), self.recompute)
        return self.done


@dataclass
class SubsetNodes:
    """A restricted build read off the whole problem (:func:`subset_nodes`): the
    :class:`NodeCosts` protocol a baseline member needs — its options, rows, bound, least
    memory and, once asked, its problem (the whole one's entries at the kept options,
    under ``memory_budget``). Its rows are the whole problem's, completed: they hold the
    edges inside a group too, so :meth:`bound` is at least a build's."""

    whole: GraphProblem
    allowed: list[np.ndarray]
    options: dict[str, list[NodeOption]]
    memory_budget: float | None
    done: GraphProblem | None = None

    def min_memory(self) -> float:
        """The least per-device memory any choice needs."""
        return sum(float(m[a].min()) for m, a in zip(self.whole.problem.memory, self.allowed,
                                                      strict=True))

    def bound(self) -> float:
        """Every group's cheapest kept option on its own (edges between groups add)."""
        return float(sum(c[a].min() for c, a in zip(self.whole.problem.cost, self.allowed,
                                                      strict=True)))

    def complete(self) -> GraphProblem:
        """The restricted problem (once)."""
        if self.done is None:
            problem = dataclasses.replace(self.whole.problem.subset(self.allowed),
                                          memory_budget=self.memory_budget)
            self.done = dataclasses.replace(self.whole, problem=problem, options=self.options)
        return self.done


def problem_key(cluster: Cluster, nodes: int, local: int, memory: MemorySpec, tie_layers: bool,
                max_weight_replication: int | None, microbatches: int,
                boundary: StageBoundary | None, grad_bucket_bytes: float,
                zero_levels: tuple[int, ...], recompute: frozenset) -> tuple:
    """What a whole problem is kept by in :attr:`BuildCache.problems` (its build's
    arguments save the budget): the plan's solves rebuild by it, and a baseline member
    built with the same arguments but a ``keep`` finds it (:func:`subset_nodes`)."""
    return (cluster, nodes, local, memory, tie_layers, max_weight_replication, microbatches,
            boundary, grad_bucket_bytes, tuple(zero_levels), frozenset(recompute))


def subset_nodes(whole: GraphProblem, keep: StrategyFilter, cache: BuildCache,
                 tie_layers: bool, memory_budget: float | None) -> SubsetNodes | None:
    """``build_nodes(…, keep=keep)`` read off ``whole``, built in ``cache`` with the same
    arguments but ``keep`` (and no weight-replication cap): each node keeps ``whole``'s
    options whose base strategy the build keeps (:func:`_kept_strategies`), in the same
    order — every option of a base strategy is the one ``cache`` priced for both — so its
    rows and edge matrices are ``whole``'s at those options, found by indexing instead of
    building. Raises ``ValueError`` where an op keeps none, as the build; None where the
    nodes of a group would keep different options, or where the graph has couplings
    (:func:`_add_shared_couplings`: their penalty is priced from every option the problem
    holds, so the whole problem's would not be the member's) — the build then decides."""
    ctx = whole.ctx
    if ctx.max_weight_replication is not None or whole.boundary.imported \
            or whole.boundary.exported:
        return None
    st = _structure(whole.graph, whole.boundary, tie_layers, cache)
    if st.couplings or st.still or st.still_within or st.input_couplings:
        return None
    picked: dict[tuple[int, bool], tuple[list[int], list[NodeOption]]] = {}
    options: dict[str, list[NodeOption]] = {}
    allowed: list[np.ndarray] = []
    for group in whole.groups:
        first = None
        for node in group:
            opts, table = whole.options[node], node in st.tied_tables
            hit = picked.get((id(opts), table))
            if hit is None:
                rep = whole.graph[node]
                kept = set(_kept_strategies(rep, node, [whole.graph[i].output for i in rep.inputs],
                                            ctx, keep, cache, table))
                idx = [k for k, o in enumerate(opts) if o.base in kept]
                hit = picked[(id(opts), table)] = (idx, [opts[k] for k in idx])
            if first is None:
                first = hit[0]
            elif hit[0] != first:
                return None
            options[node] = hit[1]
        allowed.append(np.array(first, dtype=int))
    return SubsetNodes(whole, allowed, options, memory_budget)


STRUCTURES_KEPT = 16
"""Graph structures a build cache keeps (the latest): one solve's builds share a graph or a
few (one per micro-batch count), while a pipeline's stage solves build a graph per layer
range, which a cache must not hold all of."""


@dataclass(frozen=True)
class _Structure:
    """What a build derives from the graph alone (its boundary and ``tie_layers`` aside,
    no strategy): the fused nodes (:func:`_fused_nodes`), per node whether autograd reaches
    its input, its shape (which member each follower reads) and its tie key, the tied
    tables, the groups (:func:`_tie_groups`) and the edges between nodes. The same for
    every build of one graph — the plan's and each baseline member's."""

    graph: Graph
    owner: dict[str, str]
    position: dict[str, int]
    members: dict[str, list[str]]
    # per node in order: (node, members, input reached, shape, tie class or None: the
    # index of its (tie key, shape — every member's content among it —, input reached))
    nodes: tuple[tuple[str, list[str], bool, tuple, int | None], ...]
    tied_tables: frozenset[str]
    group_key: dict[str, str]
    groups: list[list[str]]
    group_of: dict[str, int]
    # edges between nodes: (producer node, its position, consumer node, its position,
    # input index, tensor)
    edges: tuple[tuple[str, int, str, int, int, TensorSpec], ...]
    # the edges reading a shared value priced on another reader (indices into ``edges``),
    # and each such reader's coupling to the priced one: (priced node, position, input
    # index, rider node, position, input index) — see :mod:`ilp_planner.lowering.shared_reads`
    riders: frozenset[int] = frozenset()
    couplings: tuple[tuple[str, int, int, str, int, int], ...] = ()
    # edges between two pieces of functional code (``attrs.functional``, the producer not
    # the module's output): no module boundary runs a program there (indices into ``edges``)
    still: frozenset[int] = frozenset()
    # the same inside a node: a functional follower of a functional member, (node, the
    # member's position, the follower's position) — see :func:`_functional_follows`
    still_within: tuple[tuple[str, int, int], ...] = ()
    boundary: StageBoundary = field(default_factory=StageBoundary)
    # :func:`~ilp_planner.lowering.shared_reads.riders` of the graph
    rides: dict[tuple[str, int], tuple[str, int]] = field(default_factory=dict)
    # each later read of a model input read more than once, coupled to its first read:
    # (first reader's node, position, input index, this reader's node, position, index) —
    # see :func:`input_reads`
    input_couplings: tuple[tuple[str, int, int, str, int, int], ...] = ()
    # :func:`recomputed_nodes` by recomputed blocks (:meth:`recomputed_nodes`)
    recomputed: dict[frozenset, dict[str, int]] = field(default_factory=dict, compare=False)

    def recomputed_nodes(self, blocks: frozenset[tuple[str, int]]) -> dict[str, int]:
        """:func:`recomputed_nodes` of this graph, once per set of blocks."""
        hit = self.recomputed.get(blocks)
        if hit is None:
            hit = self.recomputed[blocks] = recomputed_nodes(self.graph, self.members, blocks,
                                                             self.boundary)
        return hit


def _structure(graph: Graph, boundary: StageBoundary, tie_layers: bool,
               cache: BuildCache | None) -> _Structure:
    """:class:`_Structure` of ``graph``, once per graph with ``cache``."""
    key = (id(graph), boundary, tie_layers)
    if cache is not None and key in cache.structures:
        return cache.structures[key]
    owner, position, members = _fused_nodes(graph)
    nodes, shapes, ties = [], {}, {}
    for node, mem in members.items():
        rep = graph[node]
        reached = rep.inputs[0] in graph.gradient_carriers(boundary.imported)
        # which member each follower reads; each member's gradient merges (its cost) and
        # content: a repeated op ties with its copies only where all agree (a fine-tuning
        # that freezes the first blocks: a frozen copy holds no gradient a trained one syncs)
        shape = tuple((graph[m].kind, mem.index(graph[m].inputs[0]) if i else -1,
                       gradient_merges(graph, m, boundary), _op_content(graph[m]))
                      for i, m in enumerate(mem))
        shapes[node] = shape
        tie = (ties.setdefault((rep.tie_key, shape, reached), len(ties))
               if rep.tie_key else None)
        nodes.append((node, mem, reached, shape, tie))
    # a tied table's two copies exchange whole gradients after synchronisation
    # (tied_exchange, or one AllReduce across stages): they keep their state replicated
    tied_tables = frozenset({name for op in graph.ops if op.attrs.get("tied")
                             for name in (op.name, getattr(tied_source(graph, op), "name", None))
                             } | boundary.tied_tables)
    pairs = [(src, dst) for src, dst in graph.edges()
             if graph[src].kind is not OpKind.INPUT and owner[src] != owner[dst]]
    edges = tuple((owner[src], position[src], owner[dst], position[dst],
                   graph[dst].inputs.index(src), graph[src].output) for src, dst in pairs)
    rides = riders(graph)
    riding = frozenset(i for i, (src, dst) in enumerate(pairs)
                       if (dst, graph[dst].inputs.index(src)) in rides)
    couplings = tuple((owner[d], position[d], di, owner[o], position[o], oi)
                      for (o, oi), (d, di) in rides.items())
    out = _Structure(graph, owner, position, members, tuple(nodes), tied_tables,
                     *_tie_groups(graph, members, shapes, tie_layers), edges, riding, couplings,
                     _functional_edges(graph, pairs), _functional_follows(graph, owner, position),
                     boundary, rides, tuple(
                         (owner[a], position[a], ai, owner[b], position[b], bi)
                         for reads in input_reads(graph, boundary).values()
                         for (a, ai), (b, bi) in zip(reads, reads[1:], strict=False)))
    if cache is not None:
        if len(cache.structures) >= STRUCTURES_KEPT:  # a pipeline's many stage graphs
            del cache.structures[next(iter(cache.structures))]
        cache.structures[key] = out
    return out


def input_reads(graph: Graph, boundary: StageBoundary) -> dict[str, list[tuple[str, int]]]:
    """Each model input read more than once → its reads ``(consumer, input index)`` in
    graph order (a stage's imported values aside: each reader has its own import program).
    ``parallelize`` hands the module one tensor per input, in one layout (but for unit mesh
    axes), which every reader reads: RoBERTa's ``input_ids``, looked up by the word table
    and compared with the padding index to count positions."""
    reads: dict[str, list[tuple[str, int]]] = {}
    for op in graph.ops:
        for idx, src in enumerate(op.inputs):
            if graph[src].kind is OpKind.INPUT and src not in boundary.imported:
                reads.setdefault(src, []).append((op.name, idx))
    return {src: rs for src, rs in reads.items() if len(rs) > 1}


def _functional_edges(graph: Graph, pairs: list[tuple[str, str]]) -> frozenset[int]:
    """The edges (indices into ``pairs``) from one piece of the user's functional code to
    another (``attrs.functional`` on the producer, the read functional:
    :meth:`~ilp_planner.ir.graph.Op.reads_functionally`; the module's output — the loss's
    input — is converted by the module's own boundary, so it is not one): ``parallelize`` runs
    programs at module boundaries only, so nothing may move there. An imported embedding
    whose position tables it owns counts as functional code here: the tables' own modules
    add their lookups to its output in the user's code (OPT's, GPT-2's
    ``inputs_embeds + pos_embeds``), in the embedding's output layout, so a program at
    its boundary would run before that sum and leave it in another layout than the
    plan's."""
    output = _module_output(graph)
    return frozenset(i for i, (src, dst) in enumerate(pairs)
                     if src != output and (read_inside_its_module(dst, src) or (
                         graph[dst].reads_functionally(graph[dst].inputs.index(src))
                         and (graph[src].attrs.get("functional")
                              or (graph[src].kind is OpKind.EMBEDDING
                                  and position_tables(graph[src].attrs))))))


def _functional_follows(graph: Graph, owner: dict[str, str], position: dict[str, int]
                        ) -> tuple[tuple[str, int, int], ...]:
    """:func:`_functional_edges` inside the nodes: each functional follower reading a
    functional member of its node (not the module's output), as (node, the member's
    position, the follower's position). A follower resolving its producer's partial sums
    there (``relu(F.linear(h, w))`` row-parallel) runs a program where ``parallelize``
    has no module boundary to run it."""
    output = _module_output(graph)
    return tuple((owner[op.name], position[op.inputs[0]], position[op.name])
                 for op in graph.ops
                 if op.kind is not OpKind.INPUT and owner[op.name] != op.name
                 and op.inputs[0] != output
                 and (read_inside_its_module(op.name, op.inputs[0])
                      or (op.reads_functionally(0) and graph[op.inputs[0]].attrs.get("functional"))))


def _module_output(graph: Graph) -> str | None:
    """The op whose value the module returns (the last loss's input), where a boundary
    converts it, so that a program after it is no program between pieces of functional
    code: the root's once the module returns — or, where the user's code runs element-wise
    steps on it first (``attrs.input_steps`` on the loss: Gemma-2's soft-capped logits),
    its own module's (``runtime.applied_hooks.converted_at_its_module``). None where it has
    no module then (functional code computed it, ``h @ W.T``): nothing may move there."""
    losses = [op for op in graph.ops if op.kind is OpKind.LOSS]
    if not losses:
        return None
    out = losses[-1].inputs[0]
    if losses[-1].attrs.get("input_steps") and graph[out].attrs.get("functional"):
        return None
    return out


def _fused_nodes(graph: Graph) -> tuple[dict[str, str], dict[str, int], dict[str, list[str]]]:
    """Each op's node (the op its followers fuse into, :func:`_follower`), its position in
    the node, and each node's members in graph order; an input is its own node."""
    owner: dict[str, str] = {}
    position: dict[str, int] = {}
    members: dict[str, list[str]] = {}
    for op in graph.ops:
        if op.kind is OpKind.INPUT:
            owner[op.name] = op.name
            position[op.name] = 0
            continue
        if _follower(op, graph):
            owner[op.name] = owner[op.inputs[0]]
            members[owner[op.name]].append(op.name)
        else:
            owner[op.name] = op.name
            members[op.name] = [op.name]
        position[op.name] = len(members[owner[op.name]]) - 1
    return owner, position, members


def _options_per_node(graph: Graph, st: _Structure, ctx: StrategyContext, microbatches: int,
                      again: dict[str, int], cache: BuildCache | None,
                      keep: StrategyFilter | None = None) -> dict[str, list[NodeOption]]:
    """Every node's options — one list shared by the tied copies of a repeated op, and with
    ``cache`` by every node of the same content."""
    options: dict[str, list[NodeOption]] = {}
    tied: dict[tuple, list[NodeOption]] = {}
    # derived copies of an options list (recomputed; without state sharding) by (what, list
    # id, …); each entry keeps its source list alive so the id stays valid
    recomputed_lists: dict[tuple, tuple] = {} if cache is None else cache.recomputed
    for node, mem, reached, shape, tie in st.nodes:
        merges = tuple(s[2] for s in shape)
        key = (tie, again.get(node)) if tie is not None else None
        if key is not None and key in tied:
            options[node] = tied[key]
            continue
        rep = graph[node]
        table = keep is not None and node in st.tied_tables
        if cache is None:
            opts = _node_options(graph, node, mem, ctx, microbatches, reached, keep,
                                 tied_table=table, rides=st.rides, merges=merges)
        else:
            content = (ctx, microbatches, reached, tuple(graph[i].output for i in rep.inputs),
                       tuple((*_op_content(graph[m]), mem.index(graph[m].inputs[0]) if i else -1)
                             for i, m in enumerate(mem)), merges, keep, table)
            opts = cache.options.get(content)
            if opts is None:
                opts = cache.options[content] = _node_options(
                    graph, node, mem, ctx, microbatches, reached, keep, cache, table, st.rides,
                    merges=merges)
        if node in st.tied_tables and any(o.base.zero for o in opts):
            opts = recomputed_lists.setdefault(("replicated", id(opts)), (opts, [
                o for o in opts if not o.base.zero]))[1]
        if node in again:
            copies = again[node]
            opts = recomputed_lists.setdefault((id(opts), microbatches, copies), (opts, [
                _recomputed_once(o, microbatches, copies, cache) for o in opts]))[1]
        options[node] = opts
        if key is not None:
            tied[key] = opts
    return options


def _recomputed_once(opt: NodeOption, microbatches: int, copies: int,
                     cache: BuildCache | None) -> NodeOption:
    """:func:`recomputed`, once per option with ``cache`` (the members that recompute a
    block share the options they share without recomputation)."""
    if cache is None:
        return recomputed(opt, microbatches, copies)
    key = (id(opt), microbatches, copies)
    hit = cache.recomputed_options.get(key)
    if hit is None:
        hit = cache.recomputed_options[key] = (opt, recomputed(opt, microbatches, copies))
    return hit[1]


def _tie_groups(graph: Graph, members: dict[str, list[str]], shapes: dict[str, tuple],
                tie_layers: bool) -> tuple[dict[str, str], list[list[str]], dict[str, int]]:
    """The problem's groups (one decision each): with ``tie_layers``, a repeated op ties
    with its copies that merged the same followers (the last block's op may have absorbed
    the loss, say); else every node alone. Returns each node's group key, the groups'
    members, and each node's group."""
    group_key: dict[str, str] = {}
    first_shape: dict[str, tuple] = {}
    for node in members:
        tk = graph[node].tie_key
        tied_here = tie_layers and tk and first_shape.setdefault(tk, shapes[node]) == shapes[node]
        group_key[node] = tk if tied_here else node
    group_index: dict[str, int] = {}
    groups: list[list[str]] = []
    for node in members:
        gk = group_key[node]
        if gk not in group_index:
            group_index[gk] = len(groups)
            groups.append([])
        groups[group_index[gk]].append(node)
    return group_key, groups, {node: group_index[group_key[node]] for node in members}


def _cached_facts(derived: dict[int, _ListFacts], opts: list[NodeOption]) -> _ListFacts:
    """:func:`_list_facts` of ``opts``, once per list (``derived``, by the list's id)."""
    f = derived.get(id(opts))
    if f is None:
        f = derived[id(opts)] = _list_facts(opts)
    return f


def _edge_costs(st: _Structure, cluster: Cluster, options: dict[str, list[NodeOption]],
                again: dict[str, int], microbatches: int, cost: list[np.ndarray],
                cache: BuildCache | None) -> dict[tuple[int, int], np.ndarray]:
    """The redistribution cost of every edge between nodes, as a matrix per pair of groups
    (an edge inside one group adds its diagonal to ``cost``)."""
    edges: dict[tuple[int, int], np.ndarray] = {}
    matrix_cache: dict[tuple, np.ndarray] = {}
    group_of = st.group_of
    # tied nodes share one options list: the same (lists, positions, tensor) give the same
    # layouts, so their matrix is found without hashing hundreds of layouts per edge
    by_lists: dict[tuple, np.ndarray] = {} if cache is None else cache.matrices
    uses: dict[tuple[int, int], dict[int, tuple[np.ndarray, int]]] = {}
    carriers = st.graph.gradient_carriers(st.boundary.imported)
    for i, (u, pos_u, v, pos_v, idx, tensor) in enumerate(st.edges):
        if i in st.riders:  # its program is the priced reader's (shared_reads)
            continue
        # a gradient comes back through the edge (none from an unused reader)
        back = st.members[u][pos_u] in carriers and not st.graph[st.members[v][pos_v]].unused
        quick = (id(options[u]), pos_u, id(options[v]), pos_v, idx, tensor, microbatches, back)
        r = by_lists.get(quick)
        if r is None:
            outs = tuple(o.outputs[pos_u] for o in options[u])
            ins = tuple((o.inputs[pos_v][idx], o.grads[pos_v][idx]) for o in options[v])
            key = (tensor, outs, ins, v in again, back)
            if key not in matrix_cache:
                try:
                    matrix_cache[key] = microbatches * _cost_matrix(
                        outs, ins, tensor, cluster, replay=v in again,
                        memo=None if cache is None else cache.layout_matrices, backward=back)
                except LayoutError as exc:  # the graph wires two views of one value
                    raise LayoutError(f"{st.members[v][pos_v]!r} reads {st.members[u][pos_u]!r}"
                                      f" in a layout its output cannot take: {exc}") from None
            r = by_lists[quick] = matrix_cache[key]
        # tied layers add one matrix many times: counted here, added once scaled below
        terms = uses.setdefault((group_of[u], group_of[v]), {})
        _, n = terms.get(id(r), (r, 0))
        terms[id(r)] = (r, n + 1)
    for (gu, gv), terms in uses.items():
        total = sum(n * r for r, n in terms.values())  # a new array
        if gu == gv:
            cost[gu] += np.diag(total)
        else:
            edges[(gu, gv)] = total
    return edges


def recomputed_nodes(graph: Graph, members: dict[str, list[str]],
                     blocks: frozenset[tuple[str, int]],
                     boundary: StageBoundary) -> dict[str, int]:
    """The nodes whose activations are recomputed, each with the number of recomputed
    blocks of its block family (the copies its re-materialised activations are shared
    over, :func:`recomputed`): nodes of a block in ``blocks`` whose every member is read
    only inside that block — the block's outputs stay held, as the next block's input is
    what a checkpoint saves — and is not sent to a later pipeline stage."""
    if not blocks:
        return {}
    per_family: dict[str, int] = {}
    for b, _ in blocks:
        per_family[b] = per_family.get(b, 0) + 1
    out = {}
    for node, mem in members.items():
        unit = (graph[node].block, graph[node].block_index)
        if unit not in blocks or any(i in boundary.imported for i in graph[node].inputs):
            continue
        readers = [graph.consumers(m) for m in mem]
        if all(rs and m not in boundary.exported
               and all((graph[c].block, graph[c].block_index) == unit for c in rs)
               for m, rs in zip(mem, readers, strict=True)):
            out[node] = per_family[unit[0]]
    return out


def peak_memory(gp: GraphProblem, choice) -> float:
    """The exact per-device peak of a choice: states and held activations (of
    ``boundary.inflight`` micro-batches), plus the largest block's re-materialised
    activations (recomputed blocks run their backward one at a time) and the largest op's
    transient (state sharding's gathered weights and unscattered gradients)."""
    chosen = gp.node_choice(choice)
    held = sum(o.state_bytes for o in chosen.values()) + gp.boundary.inflight * held_activations(
        gp, choice)
    block: dict[tuple, float] = {}
    for node, o in chosen.items():
        if o.recompute:
            unit = (gp.graph[node].block, gp.graph[node].block_index)
            block[unit] = block.get(unit, 0.0) + o.recompute_bytes
    return held + max(block.values(), default=0.0) + max(
        (o.transient_bytes for o in chosen.values()), default=0.0)


def held_activations(gp: GraphProblem, choice) -> float:
    """Activation bytes a choice holds per micro-batch in flight (recomputed blocks hold
    none): the part of :func:`peak_memory` that grows with the in-flight count."""
    return sum(0.0 if o.recompute else o.activation_bytes
               for o in gp.node_choice(choice).values())


@dataclass(frozen=True)
class _ListFacts:
    """Per options list, what every build reads from it: cost and memory per strategy and
    its gradient reductions as rows (strategy, buffer key number, bytes), the keys
    in order of first appearance with a sample collective each (for its latency)."""

    cost: np.ndarray
    memory: np.ndarray  # one micro-batch's activations
    held: np.ndarray  # activations held per micro-batch in flight (0 when recomputed)
    sync_k: np.ndarray
    sync_key: np.ndarray
    sync_bytes: np.ndarray
    keys: tuple[tuple, ...]
    samples: tuple[Collective, ...]


def _list_facts(opts: list[NodeOption]) -> _ListFacts:
    ks, key_of, nbytes, keys, samples = [], [], [], {}, []
    for k, o in enumerate(opts):
        for sb in o.syncs:
            key = buffer_key(sb)
            if key not in keys:
                keys[key] = len(keys)
                samples.append(sb.collective)
            ks.append(k)
            key_of.append(keys[key])
            nbytes.append(sb.collective.bytes)
    return _ListFacts(np.array([o.cost_s for o in opts]), np.array([o.memory_bytes for o in opts]),
                      np.array([0.0 if o.recompute else o.activation_bytes for o in opts]),
                      np.array(ks, dtype=np.int64), np.array(key_of, dtype=np.int64),
                      np.array(nbytes, dtype=float), tuple(keys), tuple(samples))


def _bucket_terms(uses: ListUses, cost: list[np.ndarray], cap: float, ctx: StrategyContext,
                  facts) -> BucketTerms:
    """Move each gradient reduction's latency out of its op's cost into the bucket term of
    its device group (the bandwidth part stays: it is linear in the bytes). ``uses``: the
    options lists of each group (:func:`_list_uses`); ``facts``: :class:`_ListFacts` of an
    options list."""
    distinct = list({id(opts): opts for opts, _ in uses.values()}.values())
    index: dict[tuple, int] = {}
    alpha: list[float] = []
    for opts in distinct:
        for key, c in zip(facts(opts).keys, facts(opts).samples, strict=True):
            if key not in index:
                index[key] = len(alpha)
                alpha.append(collective_seconds(c.kind, c.group_size, 0.0, ctx.cluster,
                                                c.link == "inter", c.nodes))
    # per options list (tied layers share one): the latency moved out of each strategy's
    # cost and the bytes each strategy adds to each device group's bucket term
    shared: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for opts in distinct:
        f = facts(opts)
        js = np.array([index[key] for key in f.keys], dtype=np.int64)[f.sync_key] \
            if len(f.keys) else np.zeros(0, dtype=np.int64)
        moved = np.zeros(len(opts))
        np.add.at(moved, f.sync_k, np.array(alpha)[js] if len(js) else np.zeros(0))
        nbytes = np.zeros((len(opts), len(alpha)))
        np.add.at(nbytes, (f.sync_k, js), f.sync_bytes)
        shared[id(opts)] = (moved, nbytes)
    per_group = [np.zeros((len(c), len(alpha))) for c in cost]
    for (g, lid), (_, count) in uses.items():
        moved, nbytes = shared[lid]
        cost[g] -= count * moved
        per_group[g] += count * nbytes
    return BucketTerms(np.array(alpha), per_group, cap)


def _add_boundary_programs(graph: Graph, cluster: Cluster, boundary: StageBoundary,
                           owner: dict[str, str], position: dict[str, int],
                           options: dict[str, list[NodeOption]], group_of: dict[str, int],
                           cost: list[np.ndarray], microbatches: int,
                           memo: dict[tuple, float]) -> None:
    """Per micro-batch, the stage's own boundary programs into the cost of the node that
    runs them: the export of every exported op's output, the import (gradient back) of
    every edge reading an imported tensor. ``memo`` keeps program seconds by layouts."""
    def export_s(out: Layout, tensor: TensorSpec) -> float:
        key = ("export", cluster, out, tensor)
        if key not in memo:
            memo[key] = export_program(out, tensor, cluster).seconds
        return memo[key]

    def import_s(want: Layout, grad: Layout, tensor: TensorSpec) -> float:
        key = ("import", cluster, want, grad, tensor)
        if key not in memo:
            memo[key] = import_program(want, grad, tensor, cluster).seconds
        return memo[key]

    for name in boundary.exported:
        tensor, node, pos = graph[name].output, owner[name], position[name]
        cost[group_of[node]] += microbatches * np.array(
            [export_s(o.outputs[pos], tensor) for o in options[node]])
    for dst, idx, src in ((op.name, i, s) for op in graph.ops for i, s in enumerate(op.inputs)):
        if src not in boundary.imported:
            continue
        tensor, node, pos = graph[src].output, owner[dst], position[dst]
        cost[group_of[node]] += microbatches * np.array(
            [import_s(o.inputs[pos][idx], o.grads[pos][idx], tensor) for o in options[node]])


def _add_tied_exchange(graph: Graph, cluster: Cluster, owner: dict[str, str], position: dict[str, int],
                       options: dict[str, list[NodeOption]], group_of: dict[str, int],
                       edges: dict[tuple[int, int], np.ndarray]) -> None:
    """An edge between a tied head and its embedding: the per-step gradient exchange of
    the two copies of the table (:func:`ilp_planner.lowering.strategies.tied_exchange`), priced for
    every pair of their weight layouts."""
    for op in graph.ops:
        if op.kind not in (OpKind.LINEAR, OpKind.EMBEDDING) or not op.attrs.get("tied"):
            continue
        emb = tied_source(graph, op)
        if emb is None or emb.name not in owner or position[op.name] or position[emb.name]:
            continue
        gu, gv = group_of[owner[emb.name]], group_of[owner[op.name]]
        if gu == gv:
            continue
        ew = [o.base.weight for o in options[owner[emb.name]]]
        hw = [o.base.weight for o in options[owner[op.name]]]
        uniq_e, uniq_h = {w: i for i, w in enumerate(dict.fromkeys(ew))}, \
            {w: i for i, w in enumerate(dict.fromkeys(hw))}
        small = tied_exchange_seconds(list(uniq_e), list(uniq_h), emb.master_spec, cluster,
                                      tie_transposes(op))
        r = small[np.ix_([uniq_e[w] for w in ew], [uniq_h[w] for w in hw])]
        key, mat = ((gu, gv), r) if gu < gv else ((gv, gu), r.T)
        edges[key] = edges[key] + mat if key in edges else mat.copy()


def _shared_key(opt: NodeOption, pos: int, idx: int, grads: bool = True) -> tuple[Layout, ...]:
    """A shared read's (input layout, gradient layout), unit mesh axes aside: the runtime
    runs the two on one DeviceMesh with the same placements (:func:`runtime.dtensors.rank_grid`
    drops them), so a rider reads its priced reader's value as it is. Without ``grads``
    (one of the two readers :attr:`~ilp_planner.ir.graph.Op.unused`: it hands back no
    gradient), the input layout alone."""
    read = drop_unit_axes(opt.inputs[pos][idx])
    return (read, drop_unit_axes(opt.grads[pos][idx])) if grads else (read,)


def _add_shared_couplings(st: _Structure, options: dict[str, list[NodeOption]],
                          cost: list[np.ndarray], edges: dict[tuple[int, int], np.ndarray],
                          buckets: BucketTerms | None) -> None:
    """What ``parallelize`` can run, as couplings: each rider of a shared read and its
    priced reader (:mod:`ilp_planner.lowering.shared_reads`) — the runtime runs one
    program, so the two must read one input layout and hand back their gradients in one
    layout — each edge between two pieces of functional code (``st.still``, and
    inside a node ``st.still_within``), whose value must arrive as produced, its gradient
    as the producer's — and the reads of one model input, which all read the one tensor the
    module is handed (``st.input_couplings``: one layout, unit mesh axes aside). A choice
    breaking one
    costs more than any choice's whole objective, so an exact solve never picks it while
    one keeping them exists. A penalty is no constraint: a solve stopped short, or a
    restricted build in which every choice breaks one, can still return it — the plan's
    solves and a compared configuration's price refuse it
    (:meth:`GraphProblem.refuse_unrunnable`), and ``parallelize`` refuses such a plan
    naming the producer."""
    if not st.couplings and not st.still and not st.still_within and not st.input_couplings:
        return
    penalty = 1.0 + sum(float(c.max()) for c in cost) + sum(float(r.max()) for r in edges.values())
    penalty += buckets.upper_bound() if buckets is not None else 0.0
    for node, ps, pf in st.still_within:  # a follower's resolve inside the node
        cost[st.group_of[node]] += penalty * np.array(
            [not _as_produced(o.outputs[ps], o.inputs[pf][0], o.grads[pf][0])
             for o in options[node]], dtype=float)
    for i in sorted(st.still):
        u, pos_u, v, pos_v, idx, _ = st.edges[i]
        # a value arrives as produced where both sides name one (layout, gradient layout)
        # but for unit mesh axes: compared as ids, each distinct layout normalised once
        ids: dict[tuple[Layout, Layout], int] = {}
        made = np.array([ids.setdefault(_produced_key(opt.outputs[pos_u]), len(ids))
                         for opt in options[u]])
        read = np.array([ids.setdefault(_read_key(o.inputs[pos_v][idx], o.grads[pos_v][idx]),
                                        len(ids)) for o in options[v]])
        _add_pair(cost, edges, st.group_of[u], st.group_of[v],
                  penalty * (made[:, None] != read[None, :]).astype(float))
    for d, pos_d, idx_d, o, pos_o, idx_o in st.couplings:
        # each distinct pair compared once, unit mesh axes aside (one DeviceMesh runs both)
        grads = not (st.graph[st.members[d][pos_d]].unused
                     or st.graph[st.members[o][pos_o]].unused)
        ids: dict[tuple[Layout, ...], int] = {}
        want = np.array([ids.setdefault(_shared_key(opt, pos_d, idx_d, grads), len(ids))
                         for opt in options[d]])
        have = np.array([ids.setdefault(_shared_key(opt, pos_o, idx_o, grads), len(ids))
                         for opt in options[o]])
        mat = penalty * (want[:, None] != have[None, :]).astype(float)
        _add_pair(cost, edges, st.group_of[d], st.group_of[o], mat)
    for a, pos_a, idx_a, b, pos_b, idx_b in st.input_couplings:  # one tensor per input
        ids = {}
        first = np.array([ids.setdefault(drop_unit_axes(opt.inputs[pos_a][idx_a]), len(ids))
                          for opt in options[a]])
        later = np.array([ids.setdefault(drop_unit_axes(opt.inputs[pos_b][idx_b]), len(ids))
                          for opt in options[b]])
        _add_pair(cost, edges, st.group_of[a], st.group_of[b],
                  penalty * (first[:, None] != later[None, :]).astype(float))


def _as_produced(out: Layout, read: Layout, grad: Layout) -> bool:
    """Whether a value produced in ``out`` is read in ``read``, its gradient handed back in
    ``grad``, with an empty program both ways: the same layouts but for unit mesh axes."""
    return _produced_key(out) == _read_key(read, grad)


@functools.lru_cache(maxsize=1 << 16)
def _produced_key(out: Layout) -> tuple[Layout, Layout]:
    return drop_unit_axes(out), drop_unit_axes(grad_layout(out))


@functools.lru_cache(maxsize=1 << 16)
def _read_key(read: Layout, grad: Layout) -> tuple[Layout, Layout]:
    return drop_unit_axes(read), drop_unit_axes(grad)


def _add_pair(cost: list[np.ndarray], edges: dict[tuple[int, int], np.ndarray], gu: int, gv: int,
              mat: np.ndarray) -> None:
    """Add ``mat`` (options of group ``gu`` × options of ``gv``) to the problem: to the
    edge between them (the one already there, either way round), or, within one group, its
    diagonal to the group's cost."""
    if gu == gv:
        cost[gu] += np.diag(mat)
        return
    if (gu, gv) not in edges and (gv, gu) in edges:
        gu, gv, mat = gv, gu, mat.T
    key, mat = ((gu, gv), mat) if (gu, gv) in edges or gu < gv else ((gv, gu), mat.T)
    edges[key] = edges[key] + mat if key in edges else mat


def _cost_matrix(outs: tuple[Layout, ...], ins: tuple[tuple[Layout, Layout], ...], tensor,
                 cluster: Cluster, replay: bool = False,
                 memo: dict[tuple, np.ndarray] | None = None,
                 backward: bool = True) -> np.ndarray:
    """Edge program seconds (forward + backward; forward only without ``backward``: no
    gradient comes back through the edge) for every (producer output, consumer
    (input layout, input gradient layout)) pair; with ``replay`` (a recomputed consumer)
    the forward program twice, since the recomputation runs it again. ``memo`` keeps the
    matrix between distinct layouts by those layouts in order (the same question, the same
    array: a search's direction depends on the layouts asked for alone)."""
    uniq_out = {lay: i for i, lay in enumerate(dict.fromkeys(outs))}
    uniq_in = {pair: j for j, pair in enumerate(dict.fromkeys(ins))}
    key = (cluster, tensor, tuple(uniq_out), tuple(uniq_in), replay, backward)
    small = None if memo is None else memo.get(key)
    if small is None:
        planner = planner_for(outs[0], cluster)
        small = planner.edge_costs(list(uniq_out), list(uniq_in), tensor) if backward else \
            planner.forward_costs(list(uniq_out), [a for a, _ in uniq_in], tensor)
        if replay:
            small = small + planner.forward_costs(list(uniq_out), [a for a, _ in uniq_in],
                                                  tensor)
        if memo is not None:
            memo[key] = small
    rows = [uniq_out[a] for a in outs]
    cols = [uniq_in[b] for b in ins]
    return small[np.ix_(rows, cols)]


def describe_infeasible(gp: GraphProblem, budget: float, tie_layers: bool = True) -> str:
    """Why no plan fits: the smallest per-device memory any plan needs, and the dominant
    term of the memory lower bound — the one ``validate`` names
    (:func:`~ilp_planner.lowering.cost_model.dominant_memory_term`) — with the least memory
    its ops take on a device under the strategies offered."""
    total, _ = gp.problem.min_memory()
    term = dominant_memory_term(gp.graph, gp.ctx.memory, tie_layers)
    groups = {gp.group_of[gp.owner[op]] for op in term.ops if gp.owner.get(op) in gp.group_of}
    share = sum(float(gp.problem.memory[g].min()) for g in groups)
    gib = 1024**3
    return (
        f"the smallest per-device memory any plan needs is {total / gib:.4g} GiB; the budget is "
        f"{budget / gib:.4g} GiB (dominant term: {term.label} with {share / gib:.4g} GiB at "
        f"best)"
    )

