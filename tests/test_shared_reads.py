"""A functional fan-out is priced once: one producer read by two pieces of the user's
functional code (no module boundary between them) is one value, converted once at the
producer's boundary — so the plan gives its readers one layout and prices the program on
one of them (:mod:`ilp_planner.lowering.shared_reads`), and ``parallelize``'s hook table
runs exactly that program. Single process; the torchrun launch of DeepSeek-V2 on 2 × 2
(``tests/test_hf_parallelize.py``) covers execution and the audit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ilp_planner
from formulations.elimination import solve_elimination
from formulations.sbp_ilp import SbpIlp
from ilp_planner.errors import InfeasibleError
from ilp_planner.inputs.config import load_config
from ilp_planner.inputs.importer import from_module
from ilp_planner.inter_op.given_price import price_alone
from ilp_planner.intra_op.baselines import solve_exact
from ilp_planner.intra_op.problem import build_problem
from ilp_planner.ir.graph import Op
from ilp_planner.ir.layouts import Layout, Partial
from ilp_planner.lowering.cost_model import CollectiveKind
from ilp_planner.lowering.redistribution import plan_redistribution
from ilp_planner.lowering.shared_reads import riders
from ilp_planner.lowering.strategies import Strategy
from ilp_planner.plan.programs import edge_programs
from ilp_planner.reports.explain import explain
from ilp_planner.testing import restricted_plan
from runtime.applied_hooks import hook_table
from runtime.errors import RuntimeSetupError
from runtime.executor import Executor, RunOptions
from tests.helpers.apply_check import row_parallel_proj
from tests.helpers.hf_apply_check import cluster as hf_cluster
from tests.helpers.hf_apply_check import deepseek_v2, example
from tests.helpers.user_models import CodedLinear, TwinFollowers

TOKENS, D, H = 8, 16, 32


class FanOut(nn.Module):
    """``proj``'s output read by two pieces of functional code, ``p + gate(x)`` and
    ``p * up(x)``; their product feeds the ``out`` projection."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.gate, self.up = nn.Linear(D, H), nn.Linear(D, H), nn.Linear(D, H)
        self.out = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.proj(x)
        return self.out((p + self.gate(x)) * (p * self.up(x)))


class FunctionalLinear(nn.Module):
    """A linear applied in functional code (``F.linear`` on a parameter) between two pieces
    of functional code the planner keeps whole (``cumsum``, opaque): on 4 devices every
    strategy of a linear reads its input split or leaves its output split or partial, so
    some layout changes where no module boundary runs a program — whatever the choice."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(D, H), nn.Linear(H, D)
        self.w = nn.Parameter(torch.randn(H, H) / 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cumsum(self.inp(x), dim=-1)
        return self.out(torch.cumsum(nn.functional.linear(h, self.w), dim=-1))


def cluster(devices: int = 4) -> dict:
    return {"nodes": 1, "devices_per_node": devices, "memory_gib": 16, "peak_tflops": 1,
            "links": {"intra": {"latency_us": 1, "bandwidth_gbps": 10},
                      "inter": {"latency_us": 2, "bandwidth_gbps": 5}}}


def replicated(s: Strategy) -> bool:
    return s.output.split_degree(0) == s.output.split_degree(1) == 1 \
        and not s.output.has_partial


def gathered_before_functional_code(op: Op, s: Strategy) -> bool:
    """The three projections column-parallel over 4 devices, the functional code whole on
    each: each projection's output is gathered for it (one AllGather forward; its
    gradient is sliced back, locally)."""
    if op.name in ("proj", "gate", "up"):
        return s.output.split_degree(1) == 4
    return op.name in ("out", "loss") or replicated(s)


@pytest.fixture(scope="module")
def graph():
    torch.manual_seed(0)
    return from_module(FanOut(), (torch.randn(TOKENS, D),))


def test_the_importer_marks_functional_readers_of_one_value_as_a_shared_read(graph):
    functional = {op.name for op in graph.ops if op.attrs.get("functional")}
    assert functional == {"add", "mul", "mul_1", "loss"}  # no module call of their own
    assert graph.shared_reads() == {"proj": (("add", 0), ("mul", 0))}
    assert riders(graph) == {("mul", 0): ("add", 0)}  # the first reader carries the price
    # the bare graph (for the runtime's own executor) has no functional code
    bare = from_module(FanOut(), (torch.randn(TOKENS, D),), dtensor=False)
    assert bare.shared_reads() == {}


def test_a_shared_read_is_priced_once_on_its_first_reader(graph):
    """Hand count: each projection's output (8 × 32 fp32 = 1,024 B, columns split 4 ways)
    is gathered once, in two pairwise hops — an AllGather over 2 devices of n = 512 B, then
    one of n = 1,024 B (2α + 768β, cheaper than one ring over 4: 3α + 768β) — forward only
    (the whole gradient is sliced back locally): ``proj``'s and ``gate``'s on ``add``,
    ``up``'s on ``mul``, which reads ``proj``'s gathered value as it is. Per reader, the
    plan listed ``proj``'s hops twice (8 collectives for 6 run)."""
    config = load_config({"model": graph, "cluster": cluster()})
    plan = restricted_plan(config, gathered_before_functional_code)
    layers = {ly.name: ly for ly in plan.layers}
    activation = [(ly.name, c) for ly in plan.layers for c in ly.collectives
                  if c.purpose == "activation"]
    nbytes = TOKENS * H * 4
    hops = [(CollectiveKind.ALL_GATHER, 2, nbytes / 2, "forward"),
            (CollectiveKind.ALL_GATHER, 2, nbytes, "forward")]
    assert sorted((name, c.kind, c.group_size, c.bytes, c.phase) for name, c in activation
                  if name in ("add", "mul")) == sorted(
        [("add", *h) for h in hops * 2] + [("mul", *h) for h in hops])
    assert layers["mul"].inputs[0] == layers["add"].inputs[0]
    programs = {(e.consumer, e.index): e for e in edge_programs(plan)}
    rider, priced = programs[("mul", 0)], programs[("add", 0)]
    assert (rider.role, priced.role) == ("shared", "edge")
    assert rider.program == priced.program and len(priced.program.forward) == len(hops)
    # parallelize's hook table runs that program once, on proj's output, for both readers
    reds = {k: e.program for k, e in programs.items() if e.role in ("edge", "shared")}
    _, post = hook_table(graph, layers, reds, FanOut())
    assert post["proj"] == (layers["add"].inputs[0], priced.program)


def test_the_solver_couples_a_shared_reads_layouts_and_prices_it_once(graph):
    """The solver's own plan on 1 × 4 and on 2 × 2: the two readers take one input layout
    and one gradient layout, and the plan lists the program's collectives once — exactly
    those of the priced reader's program (the rider lists none for that input)."""
    for devices, nodes in ((4, 1), (2, 2)):
        c = dict(cluster(devices), nodes=nodes)
        plan = ilp_planner.solve(graph, cluster=c, baselines=False)
        layers = {ly.name: ly for ly in plan.layers}
        programs = {(e.consumer, e.index): e.program for e in edge_programs(plan)}
        assert layers["mul"].inputs[0] == layers["add"].inputs[0]
        assert programs[("mul", 0)] == programs[("add", 0)]
        for name, reds in (("add", [programs[("add", 0)], programs[("add", 1)]]),
                           ("mul", [programs[("mul", 1)]])):
            listed = [x for x in layers[name].collectives if x.purpose == "activation"]
            assert sorted(map(str, listed)) == sorted(
                str(x) for red in reds for x in red.forward + red.backward), (devices, name)


def test_a_choice_reading_one_value_in_two_layouts_costs_more_than_any_coupled_one(graph):
    """The coupling as the problem holds it: the exact optimum of the built problem keeps
    the readers together (microseconds on this model); the same choice with ``mul`` reading
    ``proj`` in another layout than ``add`` costs more than a second — more than any
    coupled choice's whole objective — and says why ``parallelize`` could not run it."""
    config = load_config({"model": graph, "cluster": cluster()})
    gp = build_problem(graph, config.cluster, 1, 4, config.memory)
    choice, objective, _ = solve_exact(gp.problem, 30.0)
    assert objective < 1e-2 and gp.unrunnable(choice) is None
    g_add, g_mul = gp.group_of["add"], gp.group_of["mul"]
    opts = gp.options
    read = opts["add"][choice[g_add]].inputs[0][0]
    other = next(k for k, o in enumerate(opts["mul"]) if o.inputs[0][0] != read)
    broken = list(choice)
    broken[g_mul] = other
    assert gp.problem.objective(broken) > 1.0
    assert "feeds functional code in two layouts" in gp.unrunnable(broken)


def test_the_executor_refuses_a_plan_that_prices_a_shared_read_once(graph):
    """The runtime's executor converts each edge for its own op; a plan that prices a
    shared read once is for ``parallelize`` — refused up front, naming the reader."""
    config = load_config({"model": graph, "cluster": cluster()})
    plan = restricted_plan(config, gathered_before_functional_code)
    with pytest.raises(RuntimeSetupError, match="input 0 of 'mul' reads 'proj' as a shared read"):
        Executor(plan, RunOptions(), rank=0, world=4)


def test_parallelize_refuses_readers_of_one_value_handing_back_gradients_in_two_layouts(graph):
    """One value, one backward program: readers whose gradients would come back in two
    layouts (one partial over the devices, one whole) cannot share it — refused naming the
    producer, where the hook table once kept the last reader's program."""
    config = load_config({"model": graph, "cluster": cluster()})
    plan = restricted_plan(config, gathered_before_functional_code)
    layers = {ly.name: ly for ly in plan.layers}
    reds = {(e.consumer, e.index): e.program for e in edge_programs(plan)
            if e.role in ("edge", "shared")}
    read = layers["mul"].inputs[0]
    partial = Layout(read.fact, tuple(Partial() if ax.size > 1 else pl
                                      for ax, pl in zip(read.fact, read.placements, strict=True)))
    reds[("mul", 0)] = plan_redistribution(layers["proj"].output, read, graph["proj"].output,
                                           config.cluster, partial)
    with pytest.raises(RuntimeSetupError, match="'proj' feeds functional code in two gradient"):
        hook_table(graph, layers, reds, FanOut())


def test_nothing_moves_between_two_pieces_of_functional_code(graph):
    """``add`` and ``mul`` feed ``mul_1`` with no module boundary between them, where
    ``parallelize`` could run no program: every plan keeps those values as produced (the
    programs between functional ops are empty both ways), and a choice that moves one costs
    more than any that does not, naming the edge."""
    for devices, nodes in ((4, 1), (2, 2)):
        plan = ilp_planner.solve(graph, cluster=dict(cluster(devices), nodes=nodes),
                                 baselines=False)
        functional = {op.name for op in graph.ops if op.attrs.get("functional")}
        between = [e for e in edge_programs(plan)
                   if {e.producer, e.consumer} <= functional and e.consumer != "loss"]
        assert {(e.producer, e.consumer) for e in between} == {("add", "mul_1"), ("mul", "mul_1")}
        assert all(not e.program.steps and not e.program.backward_steps for e in between)
    config = load_config({"model": graph, "cluster": cluster()})
    gp = build_problem(graph, config.cluster, 1, 4, config.memory)
    choice, _, _ = solve_exact(gp.problem, 30.0)
    made = gp.options["add"][choice[gp.group_of["add"]]].outputs[0]
    other = next(k for k, o in enumerate(gp.options["mul_1"])
                 if o.inputs[0][0].split_degree(1) != made.split_degree(1))
    moved = list(choice)
    moved[gp.group_of["mul_1"]] = other
    assert gp.problem.objective(moved) > 1.0
    assert "'add' changes between two pieces of functional code" in gp.unrunnable(moved)


def test_the_ilp_and_the_elimination_find_one_coupled_optimum(graph):
    """Both exact solvers read the couplings as edge matrices of the one problem: on 1 × 4
    and 2 × 2 they reach the same objective, a choice ``parallelize`` can run."""
    config = load_config({"model": graph, "cluster": cluster()})
    for nodes, local in ((1, 4), (2, 2)):
        gp = build_problem(graph, config.cluster, nodes, local, config.memory)
        ilp = SbpIlp(gp.problem).solve(time_limit_s=60.0)
        out = solve_elimination(gp.problem)
        assert ilp is not None and ilp.status == "optimal" and out is not None
        elim = out.result
        assert elim.status == "optimal"
        assert ilp.objective == pytest.approx(elim.objective, rel=1e-9)
        assert ilp.objective < 1e-2
        assert gp.unrunnable(ilp.choice) is None and gp.unrunnable(elim.choice) is None


def test_two_merged_followers_reading_one_value_list_and_price_its_program_once():
    """``relu`` and ``silu`` both fuse into row-parallel ``proj``'s node and read its
    partial sums resolved: one value, converted once at ``proj``'s boundary. The plan lists
    that program on ``relu`` only (``silu`` rides on it), so the collectives the plan lists
    are exactly those of the programs the runtime runs (``edge`` roles) — before, each
    follower listed and priced its own copy (6 hops for 3 run)."""
    torch.manual_seed(0)
    twin = from_module(TwinFollowers(D, H), (torch.randn(TOKENS, D),))
    assert riders(twin) == {("silu", 0): ("relu", 0)}
    config = load_config({"model": twin, "cluster": cluster()})
    plan = restricted_plan(config, row_parallel_proj)
    layers = {ly.name: ly for ly in plan.layers}
    assert layers["proj"].output.has_partial and layers["relu"].strategy == "follows proj"
    programs = {(e.consumer, e.index): e for e in edge_programs(plan)}
    priced, rider = programs[("relu", 0)], programs[("silu", 0)]
    assert (priced.role, rider.role) == ("edge", "shared") and rider.program == priced.program
    assert priced.program.forward  # the partial sums are resolved: something moves
    resolve = sorted(map(str, priced.program.forward + priced.program.backward))
    assert sorted(str(c) for c in layers["relu"].collectives if c.purpose == "activation") \
        == resolve
    assert [c for c in layers["silu"].collectives if c.purpose == "activation"] == []
    listed = sorted(str(c) for ly in plan.layers for c in ly.collectives
                    if c.purpose == "activation")
    run = sorted(str(c) for e in programs.values() if e.role == "edge"
                 for c in e.program.forward + e.program.backward)
    assert listed == run
    # the price is the listed programs': the solver's objective is the realised step
    assert plan.solver.objective == pytest.approx(plan.cost.total_s, rel=1e-9)


def test_a_choice_breaking_a_coupling_is_refused_naming_it(graph):
    """The penalty path itself: the choice a solve stopped short could return (``mul``
    reading ``proj`` in another layout than ``add``) is refused, in one line naming the
    producer and what the runtime cannot do; the exact optimum passes."""
    config = load_config({"model": graph, "cluster": cluster()})
    gp = build_problem(graph, config.cluster, 1, 4, config.memory)
    choice, _, _ = solve_exact(gp.problem, 30.0)
    gp.refuse_unrunnable(choice, "the solver's choice")
    read = gp.options["add"][choice[gp.group_of["add"]]].inputs[0][0]
    broken = list(choice)
    broken[gp.group_of["mul"]] = next(k for k, o in enumerate(gp.options["mul"])
                                      if o.inputs[0][0] != read)
    with pytest.raises(InfeasibleError, match=r"the runtime cannot run the solver's choice: "
                       r"'proj' feeds functional code in two layouts"):
        gp.refuse_unrunnable(broken, "the solver's choice")


def test_a_compared_layout_the_runtime_cannot_run_is_not_priced():
    """DeepSeek-V2 under Megatron-SP on 4 devices (MLA's heads split, the rest split over
    the tokens): every choice in that layout reads ``kv_a_proj_with_mqa``'s output in two
    layouts in functional code — the restricted solve's best breaks the coupling (it was
    priced as if it ran). It is refused, and the plan reports the row as not runnable."""
    torch.manual_seed(0)
    case = deepseek_v2()
    ds = ilp_planner.from_module(case.model, example(case.inputs))
    given = "megatron: tp=4 sp=true"
    config = load_config({"model": ds, "cluster": hf_cluster(1, 4), "compare": [given]})
    with pytest.raises(InfeasibleError, match="the runtime cannot run this configuration's "
                       "layout: 'model.layers.0.self_attn.kv_a_proj_with_mqa' feeds functional"):
        price_alone(config, config.compare[0])
    plan = ilp_planner.solve(ds, cluster=hf_cluster(1, 4), baselines=False, compare=[given])
    (row,) = [ln for ln in explain(plan).splitlines() if ln.strip().startswith("given megatron")]
    assert "n/a — the runtime cannot run this configuration's layout" in row


def test_a_solve_whose_every_choice_breaks_a_coupling_returns_no_plan():
    """The plan's own solve (:func:`~ilp_planner.intra_op.solve_mesh.solve_mesh`) on a
    model whose every choice moves a value between two pieces of functional code: its
    optimum breaks a coupling (a penalty, not a constraint), and where it was returned as
    the plan — one ``parallelize`` then refused — the solve now refuses, naming the edge,
    on 1 × 4 and 2 × 2. Every choice breaks one: checked on the exact optimum of the
    built problem, whose objective exceeds the penalty."""
    torch.manual_seed(0)
    fl = from_module(FunctionalLinear(), (torch.randn(TOKENS, D),))
    assert fl["linear"].attrs.get("functional") and fl["cumsum"].attrs.get("functional")
    for nodes, local in ((1, 4), (2, 2)):
        c = dict(cluster(nodes * local), nodes=nodes, devices_per_node=local)
        config = load_config({"model": fl, "cluster": c})
        gp = build_problem(fl, config.cluster, nodes, local, config.memory)
        choice, objective, _ = solve_exact(gp.problem, 30.0)
        assert objective > 1.0 and gp.unrunnable(choice) is not None
        with pytest.raises(InfeasibleError, match=r"the runtime cannot run any choice of this "
                           r"problem .*'cumsum' changes between two pieces of functional code"):
            ilp_planner.solve(fl, cluster=c, baselines=False)


def test_a_follower_of_functional_code_reads_it_as_produced():
    """``relu(F.linear(h, w))``: the ReLU follows the functional linear inside one node.
    The unconstrained optimum on 1 × 4 was the linear row-parallel with the ReLU resolving
    its partial sums — a program between two pieces of functional code, which
    ``parallelize`` refused. Now every plan keeps the ReLU's input as produced (no program
    listed on it, its edge program empty both ways), and that choice is named as one the
    runtime cannot run."""
    torch.manual_seed(0)
    coded = from_module(CodedLinear(D, H), (torch.randn(TOKENS, D),))
    assert coded["relu"].inputs == ("linear",) and coded["linear"].attrs.get("functional")
    for nodes, local in ((1, 4), (2, 2)):
        plan = ilp_planner.solve(coded, cluster=dict(cluster(nodes * local), nodes=nodes,
                                                     devices_per_node=local), baselines=False)
        relu = next(ly for ly in plan.layers if ly.name == "relu")
        assert relu.collectives == ()
        (program,) = [e.program for e in edge_programs(plan) if e.consumer == "relu"]
        assert not program.steps and not program.backward_steps
    config = load_config({"model": coded, "cluster": cluster()})
    gp = build_problem(coded, config.cluster, 1, 4, config.memory)
    choice, _, _ = solve_exact(gp.problem, 30.0)
    assert gp.unrunnable(choice) is None
    resolving = next(k for k, o in enumerate(gp.options["linear"])
                     if o.outputs[0].has_partial and o.inputs[1][0] != o.outputs[0])
    moved = list(choice)
    moved[gp.group_of["linear"]] = resolving
    assert gp.problem.objective(moved) > 1.0
    assert "'linear' changes between two pieces of functional code (before 'relu', which " \
        "follows it)" in gp.unrunnable(moved)
