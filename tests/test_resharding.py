"""Cross-mesh resharding planner (ilp_planner.inter_op.resharding): unit tasks from specs, exact
delivery checked by assembling destination shards with numpy (even and uneven shapes),
strategy costs against Zhuang et al. §3.1, the nine Table 2 cases, plan JSON round-trip, the
``reshard`` verb, and clear errors for bad specs and overlapping meshes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from formulations.cross_mesh import SchedulerOptions
from ilp_planner.cli import main
from ilp_planner.errors import ConfigError, LayoutError, PlanFormatError
from ilp_planner.inter_op.resharding import (
    TABLE2_CASES,
    HostLinks,
    ReshardingPlan,
    ReshardOptions,
    mesh_layout,
    parse_mesh,
    plan_resharding,
    scheduling_problem,
    transfer_cost,
    unit_tasks,
)
from ilp_planner.inter_op.resharding import _unique_slices as unique_slices
from ilp_planner.ir.cluster import Cluster, Link, SubMesh
from ilp_planner.ir.graph import TensorSpec
from ilp_planner.ir.regions import chunk_bounds, device_regions, intersect, region_empty
from tests.helpers.oracles import validate_schedule

LINKS = HostLinks(Link.from_bandwidth(5, 1200), Link.from_bandwidth(10, 10))
FAST = ReshardOptions(scheduler=SchedulerOptions(
    algorithms=("naive", "load_balance", "randomized_greedy", "dfs", "cpsat"),
    time_limit_s=2, num_workers=1, dfs_budget_s=0.2, greedy_restarts=2, greedy_samples=4))

TABLE2 = TABLE2_CASES  # Zhuang et al. Table 2: (send spec, recv spec, send mesh, recv mesh)


def meshes(src: str, dst: str, dpn: int = 4, dst_node0: int | None = None,
           dst_local0: int = 0) -> tuple[SubMesh, SubMesh]:
    s = parse_mesh(src, dpn)
    d = parse_mesh(dst, dpn, s.nodes if dst_node0 is None else dst_node0, dst_local0)
    return s, d


def assemble_and_check(plan: ReshardingPlan, src_regions: dict, dst_regions: dict) -> None:
    """Give every source device its shard, replay the plan's deliveries and check that each
    destination device ends with exactly its shard, every element delivered exactly once,
    always from a device that holds it."""
    shape = plan.tensor.shape
    full = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape)

    def sl(region):
        return tuple(slice(lo, hi) for lo, hi in region)

    local = {dev: full[sl(reg)] for dev, reg in src_regions.items()}
    out = {dev: np.full([hi - lo for lo, hi in reg], np.nan) for dev, reg in dst_regions.items()}
    hits = {dev: np.zeros([hi - lo for lo, hi in reg], dtype=int)
            for dev, reg in dst_regions.items()}
    for d in plan.deliveries():
        src_reg = src_regions[d.src_device]
        assert all(slo <= lo and hi <= shi for (lo, hi), (slo, shi) in
                   zip(d.region, src_reg, strict=True)), f"device {d.src_device} lacks {d.region}"
        piece = local[d.src_device][tuple(slice(lo - slo, hi - slo) for (lo, hi), (slo, _) in
                                          zip(d.region, src_reg, strict=True))]
        dst_reg = dst_regions[d.dst_device]
        target = tuple(slice(lo - dlo, hi - dlo) for (lo, hi), (dlo, _) in
                       zip(d.region, dst_reg, strict=True))
        out[d.dst_device][target] = piece
        hits[d.dst_device][target] += 1
    for dev, reg in dst_regions.items():
        np.testing.assert_array_equal(out[dev], full[sl(reg)])
        assert (hits[dev] == 1).all(), f"device {dev}: some element not delivered exactly once"


def regions(tensor, mesh, spec):
    return device_regions(tensor, mesh, mesh_layout(mesh, spec, tensor))


@pytest.mark.parametrize(
    "shape, src_spec, dst_spec, src_mesh, dst_mesh, dst_local0, dst_node0",
    [((8, 8, 4), *case, 0, None) for case in TABLE2]
    + [
        ((7, 5, 3), "S0RR", "S0RR", "2x4", "3x4", 0, None),  # uneven: 7 rows over 3 hosts
        ((7, 5, 3), "S01RR", "RS1S0", "2x4", "3x2", 0, None),  # 7 rows over 8: one empty
        ((2, 3), "S01R", "RS01", "2x4", "1x4", 0, None),  # six of eight source shards empty
        ((5, 9), "S1S0", "S01R", "2x3", "3x2", 0, None),
        ((3, 10), "S01R", "RS01", "2x2", "2x4", 0, None),  # 3 rows over 4: an empty shard
        ((6, 6), "S0S1", "S1S0", "1x2", "1x2", 2, 0),  # two meshes on one host
        ((6, 4), "RR", "S01R", "1x2", "2x2", 2, 0),  # destination shares host 0
    ],
)
def test_assembled_destination_equals_source(shape, src_spec, dst_spec, src_mesh, dst_mesh,
                                             dst_local0, dst_node0) -> None:
    tensor = TensorSpec(shape)
    src, dst = meshes(src_mesh, dst_mesh, dst_node0=dst_node0, dst_local0=dst_local0)
    plan = plan_resharding(tensor, src, src_spec, dst, dst_spec, LINKS, FAST)
    assemble_and_check(plan, regions(tensor, src, src_spec), {
        d: r for d, r in regions(tensor, dst, dst_spec).items() if all(hi > lo for lo, hi in r)})
    problem, _ = scheduling_problem(plan.tasks, plan.strategy, LINKS)
    for task, x in zip(plan.tasks, plan.transfers, strict=True):
        assert x.sender_device in task.holders and x.sender_host in task.holder_hosts
    assert plan.makespan_s >= plan.lower_bound_s * (1 - 1e-9)
    assert plan.makespan_s == min(r.makespan_s for r in plan.runs)


@pytest.mark.parametrize("shape, src_spec, dst_spec, src_mesh, dst_mesh", [
    *[((8, 8, 4), *case) for case in TABLE2],
    ((7, 5, 3), "S01RR", "RS1S0", "2x4", "3x2"),  # uneven, an empty shard
    ((64, 6), "S01R", "S01R", "4x4", "4x4"),  # batch split: one source per destination
    ((64, 6), "S0S1", "S1S0", "4x4", "2x4"),
    ((5, 9), "S1S0", "S01R", "2x3", "3x2"),
    ((6, 4), "RR", "S01R", "1x2", "2x2"),
])
def test_unit_tasks_equal_every_pair_intersected(shape, src_spec, dst_spec, src_mesh,
                                                  dst_mesh) -> None:
    """The bisection over the most-cut dimension finds the unit tasks that intersecting
    every (destination, source) slice pair finds, in the same order (the reference here)."""
    tensor = TensorSpec(shape)
    src, dst = meshes(src_mesh, dst_mesh)
    srcs = unique_slices(regions(tensor, src, src_spec))
    dsts = unique_slices(regions(tensor, dst, dst_spec))
    pairs = [(i, j, intersect(s, d)) for j, (d, _) in enumerate(dsts)
             for i, (s, _) in enumerate(srcs) if not region_empty(intersect(s, d))]
    tasks = unit_tasks(tensor, src, src_spec, dst, dst_spec)
    assert [(t.src_slice, t.dst_slice, t.region) for t in tasks] == pairs
    assert [t.index for t in tasks] == list(range(len(pairs)))


def test_layout_objects_on_other_factorisations() -> None:
    from ilp_planner.ir.cluster import MeshAxis
    from ilp_planner.ir.layouts import B, Layout, P, S

    tensor = TensorSpec((8, 6, 4))
    src, dst = meshes("2x4", "2x4")
    three = (MeshAxis(2, 1), MeshAxis(1, 2), MeshAxis(1, 2))  # hosts, then 2 x 2 per host
    lay = Layout(three, (S(0), S(1), B))
    same = Layout.from_gspmd("S0RR", ((MeshAxis(2, 1), MeshAxis(1, 4))), rank=3)
    by_string = unit_tasks(tensor, src, "S0RR", dst, "RS01R")
    assert unit_tasks(tensor, src, same, dst, "RS01R") == by_string
    plan = plan_resharding(tensor, src, lay, dst, "RRS01", LINKS, FAST)
    assert plan.src_spec == "S^0S^1R@(2x1, 1x2, 1x2)"
    assert regions(tensor, src, lay)[1] == ((0, 4), (0, 3), (0, 4))  # device 1: local (0, 1)
    assemble_and_check(plan, regions(tensor, src, lay), regions(tensor, dst, "RRS01"))
    with pytest.raises(LayoutError, match="partial-sum layout cannot cross meshes"):
        unit_tasks(tensor, src, Layout(three, (S(0), P, B)), dst, "RRR")
    with pytest.raises(LayoutError, match="covers 2x2 devices, not the mesh's"):
        unit_tasks(tensor, src, Layout(three[:2], (S(0), B)), dst, "RRR")


def test_uneven_split_follows_torch_chunk_padding() -> None:
    assert [chunk_bounds(1024, 3, j) for j in range(3)] == [(0, 342), (342, 684), (684, 1024)]
    assert [chunk_bounds(3, 4, j) for j in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 3)]
    src, dst = meshes("2x4", "3x4")
    tasks = unit_tasks(TensorSpec((1024, 1024, 512)), src, "S0RR", dst, "S0RR")
    rows = [t.region[0][1] - t.region[0][0] for t in tasks]
    assert rows == [342, 170, 172, 340]  # case 6: destination-major, ragged slices
    assert [t.holder_hosts for t in tasks] == [(0,), (0,), (1,), (1,)]
    assert [t.receiver_hosts for t in tasks] == [(2,), (3,), (3,), (4,)]


def test_table2_unit_task_counts_and_replicas() -> None:
    tensor = TensorSpec((1024, 1024, 512))
    counts = []
    for a, b, ma, mb in TABLE2:
        src, dst = meshes(ma, mb)
        tasks = unit_tasks(tensor, src, a, dst, b)
        assert sum(t.nbytes for t in tasks if t.dst_slice == 0) > 0
        counts.append(len(tasks))
    assert counts == [2, 2, 4, 64, 4, 4, 4, 1, 4]  # case 4: "64 unit communication tasks"
    src, dst = meshes("2x4", "2x4")
    (t0, t1) = unit_tasks(tensor, src, "RRR", dst, "S0RR")  # case 2: replicas on both hosts
    assert t0.holder_hosts == (0, 1) and t0.receivers == (8, 9, 10, 11)


def test_table2_cases_scheduling_results() -> None:
    tensor = TensorSpec((1024, 1024, 512))
    for n, (a, b, ma, mb) in enumerate(TABLE2, start=1):
        src, dst = meshes(ma, mb)
        plan = plan_resharding(tensor, src, a, dst, b, LINKS, FAST)
        runs = {r.name: r.makespan_s for r in plan.runs}
        assert runs["cpsat"] <= min(runs.values()) * (1 + 1e-12), n
        assert plan.algorithm == "cpsat" and plan.status == "optimal", n
        problem, _ = scheduling_problem(plan.tasks, "broadcast", LINKS)
        assert plan.lower_bound_s == problem.lower_bound()
        if n in (3, 4, 9):  # reordering lets both sender hosts work (§5.1.2)
            assert runs["naive"] >= 1.4 * runs["cpsat"], n
            assert runs["load_balance"] >= 1.4 * runs["cpsat"], n
            assert plan.makespan_s == pytest.approx(plan.lower_bound_s, rel=1e-9), n
        if n in (1, 7, 8):  # nothing to balance or reorder
            assert runs["naive"] == pytest.approx(runs["cpsat"], rel=1e-9), n
        sp = plan.speedup_vs_allgather
        assert sp is not None and sp >= 0.999, n
        if n in (3, 4, 7, 8, 9):
            assert sp > 1.4, n


def test_strategy_costs_match_seed_003_section_3_1() -> None:
    # α = 0 and a nearly free NVLink: t = nβ; send/recv ABt, local all-gather At,
    # global all-gather ≈ 2t, broadcast t(1 + (A−1)/K).
    t_bytes = 1e9
    links = HostLinks(Link(0.0, 1e-15), Link(0.0, 1e-9))
    t = t_bytes * 1e-9
    A, B = 3, 4
    per_host = {h: B for h in range(1, A + 1)}
    cost = {s: transfer_cost(s, t_bytes, 0, per_host, links, chunks=100)
            for s in ("send_recv", "local_allgather", "global_allgather", "broadcast")}
    assert cost["send_recv"].duration == pytest.approx(A * B * t)
    assert cost["local_allgather"].duration == pytest.approx(A * t)
    assert cost["global_allgather"].duration == pytest.approx(t / 1 + (A * B - 1) / (A * B) * t)
    assert cost["broadcast"].duration == pytest.approx(t * (100 + A - 1) / 100)
    assert cost["broadcast"].chunks == 100
    # Same host: all over NVLink, no NIC term.
    intra = transfer_cost("broadcast", t_bytes, 0, {0: 3}, LINKS)
    assert intra.tail == 0 and intra.duration < 0.1 * LINKS.inter.time(t_bytes)


def test_broadcast_chunks_are_chosen_and_capped() -> None:
    one_host = transfer_cost("broadcast", 1e8, 0, {1: 1}, LINKS)
    assert one_host.chunks == 1  # A = 1, one receiving device: nothing to pipeline
    three = transfer_cost("broadcast", 1e9, 0, {1: 4, 2: 4, 3: 4}, LINKS, max_chunks=64)
    assert 1 < three.chunks <= 64
    fixed = transfer_cost("broadcast", 1e9, 0, {1: 4, 2: 4, 3: 4}, LINKS, chunks=7)
    assert fixed.chunks == 7


@pytest.mark.parametrize(
    "src_spec, dst_spec, shape, match",
    [
        ("S2RR", "S0RR", (8, 8, 8), r"source spec 'S2RR' on mesh 2x4: .*mesh axis 2"),
        ("S0RR", "RS^{012}R", (8, 8, 8), r"destination spec .*mesh axis 2"),
        ("S0RRR", "S0RR", (8, 8, 8), r"source spec 'S0RRR' .*4 dims but the tensor has rank 3"),
        ("S0R", "S0RR", (8, 8, 8), r"3"),
        ("S0RX", "S0RR", (8, 8, 8), r"unexpected character 'X'"),
        ("S0S0R", "S0RR", (8, 8, 8), r"uses mesh axis 0 twice"),
    ],
)
def test_bad_specs_give_clear_errors(src_spec, dst_spec, shape, match) -> None:
    src, dst = meshes("2x4", "2x4")
    with pytest.raises(LayoutError, match=match):
        unit_tasks(TensorSpec(shape), src, src_spec, dst, dst_spec)


def test_overlapping_or_misplaced_meshes_are_rejected() -> None:
    tensor = TensorSpec((8, 8))
    src, dst = meshes("2x4", "2x4", dst_node0=1)
    with pytest.raises(ConfigError, match=r"share device\(s\) \[4, 5, 6, 7\]"):
        plan_resharding(tensor, src, "S0R", dst, "S0R", LINKS, FAST)
    with pytest.raises(ConfigError, match="devices per host"):
        unit_tasks(tensor, SubMesh(0, 1, 0, 4, 4), "RR", SubMesh(1, 1, 0, 4, 8), "RR")
    with pytest.raises(ConfigError, match="needs 6 devices per host"):
        parse_mesh("1x4", 4, local0=2)
    with pytest.raises(ConfigError, match="expected NODESxDEVICES"):
        parse_mesh("2by4", 4)
    cluster = Cluster(3, 4, 16e9, 1e14, LINKS.intra, LINKS.inter, name="small")
    src, dst = meshes("2x4", "2x4")
    with pytest.raises(ConfigError, match="does not fit the 3x4 cluster 'small'"):
        plan_resharding(tensor, src, "S0R", dst, "S0R", cluster, FAST)
    with pytest.raises(ConfigError, match="unknown transfer strategy"):
        ReshardOptions(strategy="multicast")


def test_plan_json_round_trip_and_schedule_feasible() -> None:
    tensor = TensorSpec((64, 64, 32), "float16")
    src, dst = meshes("2x4", "2x4")
    plan = plan_resharding(tensor, src, "RS01R", dst, "S01RR", LINKS, FAST)
    d = json.loads(json.dumps(plan.to_dict()))
    back = ReshardingPlan.from_dict(d)
    assert back == plan
    assert d["makespan_s"] == plan.makespan_s and len(d["tasks"]) == 64
    assert d["order"] == list(plan.order)
    problem, _ = scheduling_problem(plan.tasks, plan.strategy, LINKS)
    from formulations.cross_mesh import ScheduledTask

    sched = tuple(ScheduledTask(x.task, problem.tasks[x.task].candidates.index(
        next(c for c in problem.tasks[x.task].candidates if c.sender == x.sender_host)),
        x.sender_host, x.start_s, x.end_s, x.finish_s) for x in plan.transfers)
    assert validate_schedule(problem, sched) == []
    with pytest.raises(PlanFormatError, match="malformed"):
        ReshardingPlan.from_dict({"tasks": []})


@pytest.mark.parametrize("src_spec, dst_spec, src_mesh, dst_mesh, dst_node0, dst_local0, shift", [
    ("S01RR", "RS01R", "2x4", "2x4", None, 0, 3),
    ("RS1S0", "S0RR", "1x4", "3x2", None, 0, 2),
    ("S0S1R", "RRS01", "2x2", "1x2", 1, 2, 5),  # meshes sharing a host
])
def test_a_shifted_plan_is_the_plan_of_the_shifted_meshes(src_spec, dst_spec, src_mesh,
                                                         dst_mesh, dst_node0, dst_local0,
                                                         shift) -> None:
    """What the pipeline planner relies on to solve each crossing shape once: moving both
    meshes by whole nodes gives the same unit tasks moved, and the moved schedule is a
    feasible schedule of the moved problem with the directly solved one's makespan."""
    tensor = TensorSpec((16, 12, 8), "float32")
    src, dst = meshes(src_mesh, dst_mesh, dst_node0=dst_node0, dst_local0=dst_local0)
    plan = plan_resharding(tensor, src, src_spec, dst, dst_spec, LINKS, FAST)
    moved = plan.shifted(shift)
    s2 = SubMesh(src.node0 + shift, src.nodes, src.local0, src.devices, src.devices_per_node)
    d2 = SubMesh(dst.node0 + shift, dst.nodes, dst.local0, dst.devices, dst.devices_per_node)
    direct = plan_resharding(tensor, s2, src_spec, d2, dst_spec, LINKS, FAST)
    assert (moved.src, moved.dst, moved.tasks) == (s2, d2, direct.tasks)
    assert moved.lower_bound_s == direct.lower_bound_s
    assert moved.makespan_s == pytest.approx(direct.makespan_s, rel=1e-12)
    problem, _ = scheduling_problem(moved.tasks, moved.strategy, LINKS)
    from formulations.cross_mesh import ScheduledTask

    sched = tuple(ScheduledTask(x.task, problem.tasks[x.task].candidates.index(
        next(c for c in problem.tasks[x.task].candidates if c.sender == x.sender_host)),
        x.sender_host, x.start_s, x.end_s, x.finish_s) for x in moved.transfers)
    assert validate_schedule(problem, sched) == []
    assemble_and_check(moved, regions(tensor, s2, src_spec), regions(tensor, d2, dst_spec))
    assert plan.shifted(0) is plan


def test_reshard_verb_prints_table_and_json(capsys) -> None:
    args = ["reshard", "--shape", "1024,1024,512", "--src-mesh", "2x4", "--src-spec", "RS^0R",
            "--dst-mesh", "2x4", "--dst-spec", "S^0RR", "--time-limit", "1", "--workers", "1",
            "--dfs-budget", "0.2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    for word in ("makespan", "lower bound", "cpsat", "naive", "randomized_greedy", "h0/d0",
                 "local_allgather"):
        assert word in out
    assert main(args + ["--json", "--algo", "naive,cpsat", "--no-compare"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in d["algorithms"]] == ["naive", "cpsat"]
    assert d["makespan_s"] == pytest.approx(d["lower_bound_s"])
    assert len(d["tasks"]) == 4 and d["strategies"] == {}


def test_reshard_verb_errors_and_cluster_file(tmp_path, capsys) -> None:
    base = ["reshard", "--shape", "8,8", "--src-mesh", "1x2", "--dst-mesh", "1x2",
            "--algo", "naive", "--no-compare"]
    assert main(base + ["--src-spec", "S2R", "--dst-spec", "RR"]) == 2
    assert "mesh axis 2" in capsys.readouterr().err
    assert main(base + ["--src-spec", "RR", "--dst-spec", "RR", "--dst-node0", "0"]) == 2
    assert "share device" in capsys.readouterr().err
    cfg = tmp_path / "c.yaml"
    cfg.write_text("cluster:\n  devices_per_node: 2\n  links:\n"
                   "    intra: {alpha: 1.0e-6, beta: 1.0e-11}\n"
                   "    inter: {latency_us: 10, bandwidth_gbps: 100}\n")
    assert main(base + ["--src-spec", "RR", "--dst-spec", "RR", "--cluster", str(cfg),
                        "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["links"]["intra"] == {"alpha": 1e-6, "beta": 1e-11}
    assert d["links"]["inter"]["beta"] == pytest.approx(8 / 100e9)
    assert d["dst"]["mesh"]["devices_per_node"] == 2 and d["dst"]["mesh"]["node0"] == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster:\n  links:\n    intra: {alpha: 1}\n    inter: {alpha: 1, beta: 1}\n")
    assert main(base + ["--src-spec", "RR", "--dst-spec", "RR", "--cluster", str(bad)]) == 2
    assert "cluster.links.intra" in capsys.readouterr().err
