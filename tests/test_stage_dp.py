"""Stage DP (Alpa §5): exact against brute force, memory by pipeline position, errors."""

from __future__ import annotations

import json
import math
import random

import pytest

from formulations.schedules import inflight_microbatches
from formulations.stage_dp import (
    StageCost,
    admissible,
    build_cost_table,
    device_step,
    pack_submeshes,
    solve_stages,
    solve_stages_from_table,
)
from ilp_planner.errors import ConfigError, InfeasibleError
from ilp_planner.ir.cluster import submesh_shapes
from tests.helpers.oracles import brute_force_stages

GiB = 2**30


def random_instance(
    seed: int, max_layers: int = 6, clusters=((1, 1), (1, 2), (1, 4), (2, 2), (2, 4), (1, 3), (2, 3))
):
    """Random stage costs (memoised so both solvers see the same numbers), budgets, stage
    counts and schedules."""
    rng = random.Random(seed)
    L = rng.randint(1, max_layers)
    nodes, dpn = rng.choice(clusters)
    D = nodes * dpn
    M = rng.randint(1, 8)
    costs: dict = {}

    def stage_cost(a, e, sh):
        if (a, e, sh) not in costs:
            z = sh[0] * sh[1]
            costs[(a, e, sh)] = (
                None
                if rng.random() < 0.1
                else StageCost(
                    time_s=(e - a) * rng.uniform(0.5, 1.5) / z ** rng.uniform(0.4, 1.0) + rng.uniform(0, 0.3),
                    memory_bytes_fixed=(e - a) * rng.uniform(1, 3) * GiB / z,
                    activation_bytes_per_microbatch=(e - a) * rng.uniform(0.1, 1) * GiB / z,
                )
            )
        return costs[(a, e, sh)]

    bcosts: dict = {}

    def boundary_cost(e, sh):
        return bcosts.setdefault((e, sh), rng.uniform(0, 0.4))

    kw = dict(
        num_layers=L,
        nodes=nodes,
        devices_per_node=dpn,
        num_microbatches=M,
        stage_cost=stage_cost,
        schedule=rng.choice(["gpipe", "1f1b", "eager-1f1b"]),
        boundary_cost=rng.choice([None, boundary_cost]),
        memory_budget_bytes=rng.choice([math.inf, rng.uniform(1, 10) * GiB]),
    )
    if rng.random() < 0.25:
        kw["num_stages"] = rng.randint(1, min(L, D))
    return kw


def _solve_both(kw):
    try:
        ref = brute_force_stages(**kw)
    except InfeasibleError:
        ref = None
    try:
        got = solve_stages(**kw)
    except InfeasibleError:
        got = None
    return ref, got


def _check_plan(plan, kw):
    """Structural checks every plan must pass."""
    L = kw["num_layers"]
    D = kw["nodes"] * kw["devices_per_node"]
    assert plan.stages[0].start == 0 and plan.stages[-1].end == L
    for a, b in zip(plan.stages, plan.stages[1:], strict=False):
        assert a.end == b.start
    assert sum(s.devices for s in plan.stages) == D
    ids = [i for s in plan.stages for i in s.placement.device_ids()]
    assert sorted(ids) == list(range(D))  # every device exactly once
    S = plan.num_stages
    for j, st in enumerate(plan.stages):
        assert st.placement.shape == st.submesh
        assert st.inflight_microbatches == inflight_microbatches(
            kw.get("schedule", "1f1b"), S - j, kw["num_microbatches"]
        )
        assert st.memory_bytes <= kw.get("memory_budget_bytes", math.inf)
    times = [s.time_s for s in plan.stages]
    assert plan.t_max_s == pytest.approx(max(times))
    assert plan.objective_s == pytest.approx(sum(times) + (plan.num_microbatches - 1) * max(times))
    json.dumps(plan.to_dict())


def test_dp_equals_brute_force_on_random_instances():
    feasible = infeasible = 0
    for seed in range(120):
        kw = random_instance(seed)
        ref, got = _solve_both(kw)
        assert (ref is None) == (got is None), seed
        if ref is None:
            infeasible += 1
            continue
        feasible += 1
        assert got.objective_s == pytest.approx(ref.objective_s, rel=1e-12), seed
        _check_plan(got, kw)
        _check_plan(ref, kw)
        if "num_stages" in kw:
            assert got.num_stages == kw["num_stages"]
    assert feasible > 60 and infeasible > 5  # the sample exercises both outcomes


def _with_variants(kw: dict, seed: int) -> dict:
    """``kw`` with every stage cost replaced by up to three variants, each slower and
    leaner than the one before (a stage that recomputes, or shards its state, to fit
    deeper in the pipeline), under a finite memory budget."""
    rng = random.Random(seed)
    base, out = kw["stage_cost"], {}

    def stage_cost(a, e, sh):
        if (a, e, sh) not in out:
            c = base(a, e, sh)
            variants = [] if c is None else [c]
            for _ in range(rng.randint(0, 2) if c is not None else 0):
                p = variants[-1]
                variants.append(StageCost(
                    p.time_s * rng.uniform(1.05, 1.6),
                    p.memory_bytes_fixed * rng.uniform(0.4, 1.0),
                    p.activation_bytes_per_microbatch * rng.uniform(0.1, 0.9)))
            out[(a, e, sh)] = variants or None
        return out[(a, e, sh)]

    return {**kw, "stage_cost": stage_cost, "memory_budget_bytes": rng.uniform(1, 6) * GiB}


def test_dp_with_stage_variants_equals_brute_force():
    """Stage costs with variants (time for memory): the DP picks per stage the fastest one
    that fits at its position, as the brute force does; fixed sub-meshes too."""
    used_variant = feasible = 0
    for seed in range(120):
        kw = _with_variants(random_instance(3000 + seed), seed)
        if seed % 4 == 0:  # a fixed assignment of sub-meshes: one shape per stage
            D = kw["nodes"] * kw["devices_per_node"]
            S = min(kw["num_layers"], D, 2)
            kw.pop("num_stages", None)
            if S == 2 and D % 2 == 0 and kw["devices_per_node"] % 2 == 0:
                kw["fixed_submeshes"] = [(kw["nodes"], kw["devices_per_node"] // 2)] * 2 \
                    if kw["nodes"] == 1 else [(kw["nodes"] // 2, kw["devices_per_node"])] * 2
        ref, got = _solve_both(kw)
        assert (ref is None) == (got is None), seed
        if ref is None:
            continue
        feasible += 1
        assert got.objective_s == pytest.approx(ref.objective_s, rel=1e-12), seed
        _check_plan(got, kw)
        for st in got.stages:  # the reported variant is the one priced
            v = kw["stage_cost"](st.start, st.end, st.submesh)
            c = v[st.variant] if isinstance(v, list) else v
            assert st.compute_time_s == c.time_s
            assert st.memory_bytes == pytest.approx(
                c.memory_bytes_fixed + st.inflight_microbatches * c.activation_bytes_per_microbatch)
        used_variant += any(st.variant > 0 for st in got.stages)
    assert feasible > 60 and used_variant > 10


def test_device_steps_of_the_usable_submeshes_keep_the_dp_exact():
    """When no stage fits below some sub-mesh size, the DP's device axis steps by the
    usable sizes' common divisor (``device_step``): same optimum as the brute force."""
    stepped = 0
    for seed in range(60):
        kw = random_instance(5000 + seed, clusters=((2, 4), (1, 4), (4, 2), (2, 6)))
        smallest = random.Random(seed).choice([2, 3, 4])
        base = kw["stage_cost"]
        kw["stage_cost"] = lambda a, e, sh, base=base, lo=smallest: (
            None if sh[0] * sh[1] < lo else base(a, e, sh))
        table = build_cost_table(kw["num_layers"], kw["nodes"], kw["devices_per_node"],
                                 kw["stage_cost"])
        stepped += device_step(table) > 1
        ref, got = _solve_both(kw)
        assert (ref is None) == (got is None), seed
        if ref is not None:
            assert got.objective_s == pytest.approx(ref.objective_s, rel=1e-12), seed
            _check_plan(got, kw)
    assert stepped > 20


def test_bisection_search_equals_alpa_enumeration():
    """The bounded bisection over T_max returns Alpa's enumeration optimum with fewer DP
    solves (medium instances: too big for brute force, many distinct stage times)."""
    fewer = 0
    for seed in range(10):
        kw = random_instance(1000 + seed, max_layers=10, clusters=((2, 4), (1, 8), (2, 6)))
        kw["num_layers"] = 10
        kw.pop("num_stages", None)
        kw["num_microbatches"] = random.Random(seed).choice([1, 2, 8, 32])
        table = build_cost_table(
            10, kw["nodes"], kw["devices_per_node"], kw["stage_cost"], boundary_cost=kw["boundary_cost"]
        )
        common = dict(
            nodes=kw["nodes"],
            devices_per_node=kw["devices_per_node"],
            schedule=kw["schedule"],
            memory_budget_bytes=kw["memory_budget_bytes"],
        )
        try:
            a = solve_stages_from_table(table, kw["num_microbatches"], search="bisect", **common)
        except InfeasibleError:
            with pytest.raises(InfeasibleError):
                solve_stages_from_table(table, kw["num_microbatches"], search="enumerate", **common)
            continue
        b = solve_stages_from_table(table, kw["num_microbatches"], search="enumerate", **common)
        assert a.objective_s == pytest.approx(b.objective_s, rel=1e-12)
        fewer += a.dp_solves <= b.dp_solves
    assert fewer >= 5


def uniform_cost(t_per_layer=1.0, fixed_per_layer=1 * GiB, act_per_layer=0.5 * GiB, comm=0.0):
    def stage_cost(a, e, sh):
        z = sh[0] * sh[1]
        n = e - a
        return StageCost(
            n * t_per_layer / z + (comm if z > 1 else 0.0), n * fixed_per_layer / z, n * act_per_layer / z
        )

    return stage_cost


def test_balanced_pipeline_on_uniform_layers():
    """8 equal layers on 1 × 4 devices, perfect scaling, 32 micro-batches: one 4-device
    stage (t = 2, objective 32·2 = 64) beats four 1-device stages of two layers (also
    t = 2 each, but Σt = 8: objective 8 + 31·2 = 70) — pipelining only adds fill time."""
    plan = solve_stages(8, 1, 4, 32, uniform_cost())
    assert plan.objective_s == pytest.approx(brute_force_stages(8, 1, 4, 32, uniform_cost()).objective_s)
    # the single 4-device stage gives t = 2 for all 8 layers: 32 · 2 = 64 < 70
    assert plan.objective_s == pytest.approx(64.0)
    assert [s.submesh for s in plan.stages] == [(1, 4)]


def test_stage_over_budget_is_never_chosen():
    """Two 1-device stages of two layers are the best plan (objective 1 + 3·0.5 = 2.5) but
    the one holding layers 0-1 needs 10 GiB > 8 GiB."""

    def cost(a, e, sh):
        if (a, e, sh) == (0, 2, (1, 1)):
            return StageCost(0.5, 10 * GiB, 0.0)
        per_layer = 0.25 if sh == (1, 1) else 0.5  # the 2-device mesh scales badly
        return StageCost((e - a) * per_layer, GiB, 0.0)

    free = solve_stages(4, 1, 2, 4, cost)
    assert (free.stages[0].start, free.stages[0].end, free.stages[0].submesh) == (0, 2, (1, 1))
    assert free.objective_s == pytest.approx(2.5)
    tight = solve_stages(4, 1, 2, 4, cost, memory_budget_bytes=8 * GiB)
    assert all((s.start, s.end, s.submesh) != (0, 2, (1, 1)) for s in tight.stages)
    assert tight.objective_s == pytest.approx(3.25)  # 1 + 3 layers: 1 + 3·0.75
    assert tight.objective_s == pytest.approx(
        brute_force_stages(4, 1, 2, 4, cost, memory_budget_bytes=8 * GiB).objective_s
    )


def test_memory_depends_on_pipeline_position():
    """1F1B: the first of S stages holds S micro-batches, the last holds one. A stage whose
    activations only fit once must be placed last."""

    def cost(a, e, sh):
        heavy = a == 0  # any stage containing layer 0 has big activations
        return StageCost(float(e - a), 1 * GiB, (3 if heavy else 1) * GiB)

    # two single-device stages: the first stage (position 2) holds 2 micro-batches
    budget = 6 * GiB
    plan = solve_stages(2, 1, 2, 8, cost, memory_budget_bytes=budget, schedule="1f1b")
    ref = brute_force_stages(2, 1, 2, 8, cost, memory_budget_bytes=budget, schedule="1f1b")
    assert plan.objective_s == pytest.approx(ref.objective_s)
    # stage with layer 0 at position 2: 1 + 2·3 = 7 GiB > 6 → the only option is one stage
    # on both devices (position 1: 1 + 3 = 4 GiB)
    assert [s.submesh for s in plan.stages] == [(1, 2)]
    # GPipe holds all 8 micro-batches everywhere: infeasible for the same budget
    with pytest.raises(InfeasibleError):
        solve_stages(2, 1, 2, 8, cost, memory_budget_bytes=budget, schedule="gpipe")
    # eager-1F1B: position 2 holds 3 micro-batches
    for sched in ("1f1b", "eager-1f1b"):
        for budget in (7 * GiB, 10 * GiB, 12 * GiB):
            p = solve_stages(2, 1, 2, 8, cost, memory_budget_bytes=budget, schedule=sched)
            r = brute_force_stages(2, 1, 2, 8, cost, memory_budget_bytes=budget, schedule=sched)
            assert p.objective_s == pytest.approx(r.objective_s), (sched, budget)


def test_impossible_budget_raises_with_the_numbers():
    """One device, 6 layers of 4 GiB weights + 1 GiB activations: the least any assignment
    needs is 6·4 + 6·1 = 30 GiB (single stage, one micro-batch in flight)."""
    cost = uniform_cost(fixed_per_layer=4 * GiB, act_per_layer=1 * GiB)
    with pytest.raises(InfeasibleError) as err:
        solve_stages(6, 1, 1, 8, cost, memory_budget_bytes=8 * GiB)
    msg = str(err.value)
    assert "8 GiB" in msg and "30 GiB" in msg and "layers 0–5 on 1×1" in msg
    # two devices: one 2-device stage needs 24/2 + 6/2 = 15 GiB; two 1-device stages of
    # 3 + 3 layers need 3·4 + 2·3 = 18 GiB on the first (2 micro-batches in flight)
    with pytest.raises(InfeasibleError, match="least memory any assignment needs is 15 GiB"):
        solve_stages(6, 1, 2, 8, cost, memory_budget_bytes=8 * GiB)


def test_infeasible_error_reports_the_exact_least_memory():
    """The reported need is the min over assignments of the peak stage memory: brute force
    is feasible with exactly that budget and infeasible just below it."""
    checked = 0
    for seed in range(60):
        kw = random_instance(seed)
        kw["memory_budget_bytes"] = 0.01 * GiB
        with pytest.raises(InfeasibleError) as err:
            solve_stages(**kw)
        need = err.value.needed_bytes
        if need is None:  # infeasible for another reason (stage count, undefined costs)
            continue
        assert need > kw["memory_budget_bytes"] and err.value.budget_bytes == 0.01 * GiB
        ok = brute_force_stages(**{**kw, "memory_budget_bytes": need})
        assert max(st.memory_bytes for st in ok.stages) == pytest.approx(need)
        with pytest.raises(InfeasibleError):
            brute_force_stages(**{**kw, "memory_budget_bytes": need * (1 - 1e-9)})
        checked += 1
    assert checked >= 30


def test_a_stage_solvers_lower_bounds_are_what_the_message_claims():
    """With ``least_memory`` (a stage solver whose plans are more than the table's
    variants), the message gives the min-max of its lower bounds, ``at least``: half of
    every variant's memory gives half the table's own least need, named as a bound; bounds
    within the budget prove nothing, and the message gives no figure."""
    checked = 0
    for seed in range(40):
        kw = random_instance(seed)
        kw["memory_budget_bytes"] = 0.01 * GiB
        cost = kw["stage_cost"]
        with pytest.raises(InfeasibleError) as plain:
            solve_stages(**kw)
        if plain.value.needed_bytes is None:
            continue

        def half(k, i, shape, n, cost=cost):
            return 0.5 * cost(k, i + 1, shape).memory(n)

        with pytest.raises(InfeasibleError) as bounded:
            solve_stages(**kw, least_memory=half)
        assert bounded.value.needed_bytes == pytest.approx(0.5 * plain.value.needed_bytes)
        assert "needs is at least" in str(bounded.value)
        with pytest.raises(InfeasibleError) as unproven:
            solve_stages(**kw, least_memory=lambda k, i, shape, n: 0.0)
        assert unproven.value.needed_bytes is None
        assert "where none of its plans fits" in str(unproven.value)
        checked += 1
    assert checked >= 20


def test_all_stages_undefined_raises():
    with pytest.raises(InfeasibleError, match="stage_cost returned None"):
        solve_stages(3, 1, 2, 4, lambda a, e, sh: None)


def test_fixed_stage_count_and_fixed_submeshes():
    cost = uniform_cost(comm=0.1)
    for S in (1, 2, 3):
        p = solve_stages(6, 2, 2, 4, cost, num_stages=S)
        assert p.num_stages == S
        assert p.objective_s == pytest.approx(brute_force_stages(6, 2, 2, 4, cost, num_stages=S).objective_s)
    fixed = [(1, 1), (1, 2), (1, 1)]
    p = solve_stages(6, 1, 4, 4, cost, fixed_submeshes=fixed)
    assert [s.submesh for s in p.stages] == fixed
    assert p.objective_s == pytest.approx(
        brute_force_stages(6, 1, 4, 4, cost, fixed_submeshes=fixed).objective_s
    )
    with pytest.raises(ConfigError, match="use 3 devices"):
        solve_stages(6, 1, 4, 4, cost, fixed_submeshes=[(1, 1), (1, 2)])
    with pytest.raises(ConfigError, match="stages impossible"):
        solve_stages(3, 1, 4, 4, cost, num_stages=4)


def test_imbalance_tolerance_prunes_before_costing():
    calls = []

    def cost(a, e, sh):
        calls.append((a, e, sh))
        return uniform_cost()(a, e, sh)

    plan = solve_stages(4, 1, 4, 8, cost, imbalance_tolerance=0.0)
    # τ = 0: a mesh's device share must equal its share of the layers
    for a, e, sh in calls:
        assert (sh[0] * sh[1]) / 4 == pytest.approx((e - a) / 4)
    assert all(s.devices == s.end - s.start for s in plan.stages)
    assert admissible(0, 1, (1, 1), 4, 4, 0.0, [0, 1, 2, 3, 4])
    assert not admissible(0, 1, (1, 2), 4, 4, 0.0, [0, 1, 2, 3, 4])
    assert admissible(0, 1, (1, 2), 4, 4, 1.0, [0, 1, 2, 3, 4])
    # the exact all-layers ⇔ all-devices rule is always on
    assert not admissible(0, 4, (1, 2), 4, 4, None, None)
    assert not admissible(0, 3, (1, 4), 4, 4, None, None)
    for seed in range(30):
        kw = random_instance(500 + seed)
        kw["imbalance_tolerance"] = 0.5
        kw["layer_work"] = [1.0 + (i % 3) for i in range(kw["num_layers"])]
        ref, got = _solve_both(kw)
        assert (ref is None) == (got is None)
        if ref is not None:
            assert got.objective_s == pytest.approx(ref.objective_s, rel=1e-12)


@pytest.mark.parametrize("dpn", [3, 6])
def test_three_and_six_devices_per_node(dpn):
    shapes = submesh_shapes(2, dpn)
    assert shapes == sorted({(1, d) for d in range(1, dpn + 1) if dpn % d == 0} | {(1, dpn), (2, dpn)})
    assert (1, 3) in shapes and (1, 4) not in shapes
    cost = uniform_cost(comm=0.05)
    for M in (1, 4):
        kw = dict(
            num_layers=5,
            nodes=2,
            devices_per_node=dpn,
            num_microbatches=M,
            stage_cost=cost,
            memory_budget_bytes=6 * GiB,
        )
        ref, got = _solve_both(kw)
        assert got.objective_s == pytest.approx(ref.objective_s)
        _check_plan(got, kw)


def test_pack_submeshes():
    meshes = pack_submeshes([(1, 3), (1, 2), (2, 6), (1, 1), (1, 6)], 4, 6)
    ids = sorted(i for m in meshes for i in m.device_ids())
    assert ids == list(range(24))
    assert meshes[2].nodes == 2 and meshes[2].local0 == 0
    assert meshes[0].node0 == meshes[1].node0 == meshes[3].node0  # 3 + 2 + 1 share a node
    # 30 devices per node: the divisors 15, 10, 6 do not pack (documented limitation)
    with pytest.raises(InfeasibleError, match="cannot be packed"):
        pack_submeshes([(1, 15), (1, 10), (1, 10), (1, 6), (1, 6), (1, 6), (1, 6), (1, 1)], 2, 30)


def test_bad_shapes_are_config_errors():
    with pytest.raises(ConfigError, match="cannot be placed"):
        solve_stages(2, 2, 4, 2, uniform_cost(), submesh_shapes=[(2, 2), (1, 4)])
    with pytest.raises(ConfigError, match="cannot be placed"):
        solve_stages(2, 1, 4, 2, uniform_cost(), submesh_shapes=[(1, 3), (1, 1)])
