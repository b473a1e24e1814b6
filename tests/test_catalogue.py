"""The hardware catalogue (accelerators and links by name), the NCCL-style collective model
against hand-computed cases, and the lowering's choice of one collective or a chain under it."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import sys

import numpy as np
import pytest

from ilp_planner import cli
from ilp_planner.api import solve
from ilp_planner.errors import ConfigError, LayoutError
from ilp_planner.inputs import models
from ilp_planner.inputs.config import load_config, parse_config, section_mapping
from ilp_planner.intra_op.problem import build_problem
from ilp_planner.intra_op.realise import realise
from ilp_planner.ir.cluster import Cluster, Link, MeshAxis
from ilp_planner.ir.device import DEVICES, device_names
from ilp_planner.ir.graph import TensorSpec
from ilp_planner.ir.layouts import B, Layout, P
from ilp_planner.ir.links import LINKS, catalogue_cluster, catalogue_link, link_names
from ilp_planner.lowering.cost_model import (
    CollectiveKind,
    MemorySpec,
    collective_time,
    nccl_algorithm,
    nccl_allreduce_times,
    nccl_time,
)
from ilp_planner.lowering.redistribution import (
    plan_redistribution,
    step_kernel_seconds,
    step_local_seconds,
)
from ilp_planner.plan.data import Plan
from ilp_planner.reports.explain import explain, fmt_bytes
from tests.helpers.procs import ROOT, run

AR = CollectiveKind.ALL_REDUCE


def doc(cluster: dict, dtype: str = "bfloat16") -> dict:
    return {"name": "cat", "model": {"kind": "mlp", "dims": [16, 16], "batch": 8, "dtype": dtype},
            "cluster": cluster}


NAMED = {"gpu": "a100-80gb", "nodes": 2, "devices_per_node": 8, "intra": "nvlink3",
         "inter": "8x-ib-hdr200"}


def parse(cluster: dict, dtype: str = "bfloat16") -> Cluster:
    return parse_config(doc(cluster, dtype), "cat.yaml").cluster


# -- the catalogue ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec", LINKS, ids=lambda s: s.name)
def test_every_link_entry_loads_at_both_levels(spec):
    names = [spec.name, f"4x-{spec.name}"] if spec.per_nic else [spec.name]
    for name in names:
        nics = 4 if name.startswith("4x-") else 1
        c = parse({**NAMED, "intra": name, "inter": name})
        for link in (c.intra, c.inter):
            assert link.alpha == pytest.approx(spec.latency_us * 1e-6)
            assert link.launch == pytest.approx(spec.launch_us * 1e-6)
            # β is 1 / bus bandwidth (GB/s = 1e9 B/s), scaled by the NIC count
            assert 1.0 / link.beta == pytest.approx(spec.busbw_gbs * 1e9 * nics)
        assert c.collectives == "nccl"


@pytest.mark.parametrize("device", DEVICES, ids=lambda d: d.name)
def test_every_device_entry_loads_with_the_peak_of_the_model_dtype(device):
    for name in (device.name, *device.aliases):
        half = parse({**NAMED, "gpu": name}, "bfloat16")
        assert half.device == device and half.memory_bytes == device.memory_bytes
        assert half.peak_flops == device.peak("bfloat16")
        assert half.name == f"2x8-{device.name}"
        fp32 = parse({**NAMED, "gpu": name}, "float32")
        assert fp32.peak_flops == device.peak_flops["float32"] < parse(
            {**NAMED, "gpu": name}, "float16").peak_flops
        # a device without bf16 tensor cores (V100) runs bf16 at fp32's peak, not fp16's
        assert half.peak_flops == device.peak_flops.get("bfloat16", fp32.peak_flops)


def test_names_are_case_insensitive():
    c = parse({**NAMED, "gpu": "A100-80GB", "intra": "NVLink3", "inter": "8X-IB-HDR200"})
    assert c == parse(NAMED)


def test_numbers_override_the_catalogue():
    c = parse({**NAMED, "memory_gib": 70, "peak_tflops": 100, "name": "mine",
               "links": {"inter": {"bandwidth_gbps": 800}, "intra": {"launch_us": 2}}})
    base = parse(NAMED)
    assert c.memory_bytes == 70 * 2**30 and c.peak_flops == 100e12 and c.name == "mine"
    assert c.device == base.device  # still the A100 for the roofline
    assert c.inter == Link(base.inter.alpha, 8.0 / 800e9, base.inter.launch)
    assert c.intra == Link(base.intra.alpha, base.intra.beta, 2e-6)
    fitted = parse({**NAMED, "links": {"inter": {"alpha": 1e-5, "beta": 1e-10, "launch": 0}}})
    assert fitted.inter == Link(1e-5, 1e-10, 0.0)


def test_sweeps_and_overrides_set_names_by_dotted_key():
    config = load_config(ROOT / "configs" / "gpt-13b-a100-2x8.yaml")
    faster = config.with_overrides({"cluster.inter": "8x-IB-NDR400", "cluster.gpu": "h100"})
    assert faster.cluster.inter == catalogue_link("8x-ib-ndr400")
    assert faster.cluster.peak_flops == 989e12 and faster.cluster.name == "2x8-h100-sxm"
    slower = config.with_overrides({"cluster.links.inter.bandwidth_gbps": 100})
    assert slower.cluster.inter.beta == 8 / 100e9
    assert slower.cluster.inter.launch == config.cluster.inter.launch


def test_collective_model_defaults_and_choice():
    raw = {"nodes": 2, "devices_per_node": 8, "memory_gib": 80, "peak_tflops": 312,
           "links": {"intra": {"latency_us": 5, "bandwidth_gbps": 2400},
                     "inter": {"latency_us": 10, "bandwidth_gbps": 200}}}
    assert parse(raw).collectives == "ring"  # raw numbers keep today's prices
    assert parse(raw).intra.launch == 0.0 and parse(raw).device is None
    assert parse({**raw, "collectives": "nccl"}).collectives == "nccl"
    assert parse({**NAMED, "collectives": "ring"}).collectives == "ring"
    # one level named is enough for the NCCL default; its numbers given too override the
    # named figures they give (here α and β), the launch cost stays the catalogue's
    mixed = parse({**raw, "intra": "nvlink4", "gpu": "h200"})
    assert mixed.collectives == "nccl"
    assert mixed.intra == Link(5 * 1e-6, 8 / 2400e9, catalogue_link("nvlink4").launch)
    assert mixed.memory_bytes == 80 * 2**30  # memory_gib overrides the H200's 141 GiB


BAD = [
    ({"gpu": "a200"}, "cluster.gpu", "unknown device 'a200'"),
    ({"intra": "nvlink5"}, "cluster.intra", "unknown link 'nvlink5'"),
    ({"inter": "2x-nvlink3"}, "cluster.inter", "unknown link '2x-nvlink3'"),
    ({"inter": "0x-ib-hdr200"}, "cluster.inter", "1 to 64 NICs"),
    ({"inter": "100x-ib-ndr400"}, "cluster.inter", "1 to 64 NICs"),
    ({"inter": 200}, "cluster.inter", "string"),
    ({"collectives": "tree"}, "cluster.collectives", "unknown collective model 'tree'"),
    ({"links": {"inter": {"launch_us": 1, "launch": 1e-6}}}, "cluster.links.inter", "not both"),
    ({"links": {"inter": {"alpha": 1e-6, "latency_us": 1}}}, "cluster.links.inter", "not both"),
    ({"links": {"ethernet": {}}}, "cluster.links.ethernet", "unknown key"),
]


@pytest.mark.parametrize("change,key,phrase", BAD, ids=[b[1] + ":" + b[2][:20] for b in BAD])
def test_bad_names_and_keys_name_the_key(change, key, phrase):
    with pytest.raises(ConfigError) as info:
        parse({**NAMED, **change})
    assert str(info.value).startswith(f"cat.yaml: {key}: "), info.value
    assert phrase in str(info.value)


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ConfigError, match="nvlink3") as info:
        parse({**NAMED, "intra": "nvlink"})
    assert all(n in str(info.value) for n in link_names())
    with pytest.raises(ConfigError) as info:
        parse({**NAMED, "gpu": "b200"})
    assert all(n in str(info.value) for n in device_names())


def test_what_is_missing_without_names():
    bare = {"nodes": 2, "devices_per_node": 8}
    with pytest.raises(ConfigError, match="cluster.memory_gib: missing required key.*cluster.gpu"):
        parse(bare)
    with pytest.raises(ConfigError, match="cluster.links: missing required key 'links'"):
        parse({**bare, "gpu": "l4", "intra": "pcie4"})
    with pytest.raises(ConfigError, match="cluster.links.inter: missing required key 'inter'"):
        parse({**bare, "gpu": "l4", "intra": "pcie4", "links": {}})
    with pytest.raises(ConfigError, match="cluster.links.inter.bandwidth_gbps: missing"):
        parse({**bare, "gpu": "l4", "intra": "pcie4", "links": {"inter": {"latency_us": 3}}})


def test_cluster_objects_and_plans_round_trip(tmp_path):
    c = dataclasses.replace(catalogue_cluster("h100", 2, 8, "nvlink4", "8x-ib-ndr400"),
                            intra=Link(3e-7, 1 / 370e9, 1.7e-6 / 3))
    assert parse(section_mapping(c)) == c
    assert parse(section_mapping(c)).device == c.device
    config = load_config(ROOT / "configs" / "gpt-13b-a100-2x8.yaml").with_overrides(
        {"model.layers": 1, "model.hidden": 256, "model.heads": 4, "model.vocab": 512,
         "model.seq_len": 64})
    plan = solve(config, baselines=False)
    plan.save(tmp_path / "p.json")
    again = parse_config(Plan.load(tmp_path / "p.json").config).cluster
    assert again == config.cluster and again.device == config.cluster.device
    assert again.collectives == "nccl" and again.inter == catalogue_link("8x-ib-hdr200")
    # the reports read the cluster by its names and the figures they stand for
    text = explain(Plan.load(tmp_path / "p.json"))
    assert "2 × 8 a100-40gb devices, 40 GiB and 312 TFLOP/s each; intra nvlink3; " \
           "inter 8x-ib-hdr200; nccl collectives" in text
    assert f"of {fmt_bytes(config.cluster.memory_bytes)}" in text


def test_reshard_reads_a_catalogue_cluster_file(capsys):
    args = ["reshard", "--shape", "8,8", "--src-mesh", "1x2", "--dst-mesh", "1x2",
            "--src-spec", "RR", "--dst-spec", "RR", "--algo", "naive", "--no-compare",
            "--cluster", str(ROOT / "configs" / "gpt-13b-a100-2x8.yaml"), "--json"]
    assert cli.main(args) == 0
    d = json.loads(capsys.readouterr().out)
    nv, ib = catalogue_link("nvlink3"), catalogue_link("8x-ib-hdr200")
    assert Link(**d["links"]["intra"]) == nv and Link(**d["links"]["inter"]) == ib
    assert d["dst"]["mesh"]["devices_per_node"] == 8


# -- the collective model, by hand ---------------------------------------------------------------

INTRA = Link(alpha=1e-6, beta=1e-9, launch=5e-6)
INTER = Link(alpha=1e-5, beta=1e-8, launch=5e-6)


def test_allreduce_ring_and_tree_by_hand():
    # 16 devices on 4 nodes (4 each), n = 10,000 bytes:
    # ring: 5 + 2(16-4)·1 + 2(4-1)·10 = 89 µs, plus 2·15/16 · n · 1e-8 = 187.5 µs
    # tree: 5 + 2((4-1)·1 + log2(4)·10) = 51 µs, plus 2n · 1e-8 / 0.9 = 222.2 µs
    t = nccl_allreduce_times(16, 10_000, INTRA, INTER, nodes=4)
    assert t["ring"] == pytest.approx(89e-6 + 187.5e-6)
    assert t["tree"] == pytest.approx(51e-6 + 2e-4 / 0.9)
    assert nccl_time(AR, 16, 10_000, INTRA, INTER, 4) == min(t.values())


def test_ring_tree_switch_point():
    # tree wins while its 38 µs latency saving exceeds its extra bandwidth time:
    # 38e-6 = n · 1e-8 · (2/0.9 - 2·15/16)  ->  n* = 10,944 bytes
    switch = 38e-6 / (1e-8 * (2 / 0.9 - 2 * 15 / 16))
    assert switch == pytest.approx(10_944, abs=1)
    assert nccl_algorithm(16, switch * 0.99, INTRA, INTER, 4) == "tree"
    assert nccl_algorithm(16, switch * 1.01, INTRA, INTER, 4) == "ring"
    # inside one node the tree is a chain: ring latency, less bandwidth — never chosen
    assert all(nccl_algorithm(8, n, INTRA, INTER, 1) == "ring" for n in (0, 8, 1e3, 1e9))
    # a deeper tree: 64 single-device nodes, log2(64) = 6 crossings against the ring's 126
    assert nccl_allreduce_times(64, 0, INTRA, INTER, 64)["tree"] == pytest.approx(5e-6 + 12e-5)


def test_catalogue_switch_point_and_launch_cost():
    c = catalogue_cluster("a100-80gb", 2, 8, "nvlink3", "8x-ib-hdr200")
    ai, ao, beta = c.intra.alpha, c.inter.alpha, c.inter.beta
    saving = (2 * 14 * ai + 2 * ao) - 2 * (7 * ai + ao)  # ring minus tree latency
    switch = saving / (beta * (2 / 0.9 - 2 * 15 / 16))
    assert 3e6 < switch < 4e6  # 3.6 MB, as the cost model's docstring says
    assert nccl_algorithm(16, switch * 0.99, c.intra, c.inter, 2) == "tree"
    assert nccl_algorithm(16, switch * 1.01, c.intra, c.inter, 2) == "ring"
    # every call pays the launch once; a single device issues no call
    assert nccl_time(AR, 1, 1e6, c.intra, c.inter) == 0.0
    assert nccl_time(CollectiveKind.P2P, 2, 0, c.intra, c.inter) == c.intra.launch + ai
    gather = nccl_time(CollectiveKind.ALL_GATHER, 16, 1600, c.intra, c.inter, 2)
    assert gather == pytest.approx(c.inter.launch + 14 * ai + ao + 15 / 16 * 1600 * beta)


def test_nccl_all_to_all_sends_to_node_peers_and_remote_peers_at_once():
    """An AllToAll of 16 devices on 2 nodes: 7 peers over NVLink and 8 over the network
    concurrently — the network's 8/16 of the bytes set the time; within one node, or with
    every rank on its own node, it is the ring formula."""
    c = catalogue_cluster("h100", 2, 8, "nvlink3", "8x-ib-hdr200")
    A2A = CollectiveKind.ALL_TO_ALL
    n = 64 * 2**20
    got = nccl_time(A2A, 16, n, c.intra, c.inter, 2)
    assert got == pytest.approx(c.inter.launch + 7 * c.intra.alpha + 8 * c.inter.alpha
                                + max(7 / 16 * n * c.intra.beta, 8 / 16 * n * c.inter.beta))
    assert got < collective_time(A2A, 16, n, c.inter)  # the ring prices 15/16 on the network
    assert nccl_time(A2A, 8, n, c.intra, c.inter, 1) == collective_time(A2A, 8, n, c.intra)
    assert nccl_time(A2A, 4, n, c.intra, c.inter, 4) == pytest.approx(
        collective_time(A2A, 4, n, c.inter))


def test_ring_model_is_the_textbook_formula_plus_launch():
    raw = Link(alpha=2e-6, beta=3e-9)
    assert collective_time(AR, 8, 1000, raw) == 2 * 7 * 2e-6 + 2 * 7 / 8 * 1000 * 3e-9
    with_launch = Link(2e-6, 3e-9, launch=4e-6)
    assert collective_time(AR, 8, 1000, with_launch) == pytest.approx(
        collective_time(AR, 8, 1000, raw) + 4e-6)


# -- one collective or a chain ------------------------------------------------------------------

FACT = (MeshAxis(2, 8),)


def _program(cluster: Cluster, nbytes: int):
    tensor = TensorSpec((nbytes // 4,), "float32")
    return plan_redistribution(Layout(FACT, (P,)), Layout(FACT, (B,)), tensor, cluster)


def _as_nccl(red, cat: Cluster, backward: bool = True) -> float:
    """A program's steps priced under the catalogue cluster's model: each call's NCCL time
    and the local kernels the runtime runs around it, a slice's copy (both programs'
    steps alike)."""
    steps = [*red.steps, *(red.backward_steps if backward else ())]
    return sum((0.0 if s.collective is None else nccl_time(
        s.collective.kind, s.collective.group_size, s.collective.bytes, cat.intra, cat.inter,
        s.collective.nodes)) + step_kernel_seconds(s, red.tensor, cat) for s in steps)


def test_catalogue_cluster_issues_one_allreduce_where_nccl_would():
    cat = catalogue_cluster("a100-80gb", 2, 8, "nvlink3", "8x-ib-hdr200")
    ring = dataclasses.replace(cat, collectives="ring", intra=Link(cat.intra.alpha, cat.intra.beta),
                               inter=Link(cat.inter.alpha, cat.inter.beta))
    for nbytes in (1024, 2**16, 2**20):
        one = _program(cat, nbytes)
        assert [c.kind for c in one.forward] == [AR], nbytes
        assert one.forward_seconds == pytest.approx(
            nccl_time(AR, 16, nbytes, cat.intra, cat.inter, nodes=2)
            + step_kernel_seconds(one.steps[0], one.tensor, cat))
        # the textbook ring (same α and β, no launch) saves α with a reduce-scatter and
        # pairwise gathers: cheaper under that model, dearer under NCCL's
        chain = _program(ring, nbytes)
        assert len(chain.forward) > 2
        assert chain.forward_seconds < collective_time(AR, 16, nbytes, ring.inter) \
            + step_local_seconds(AR, nbytes, 16, False, chain.tensor, ring)
        assert _as_nccl(chain, cat, backward=False) > one.forward_seconds


def test_a_chain_only_where_cheaper_under_the_model():
    cat = catalogue_cluster("a100-80gb", 2, 8, "nvlink3", "8x-ib-hdr200")
    for nbytes in (2**10, 2**20, 2**24, 2**28):
        prog = _program(cat, nbytes)
        single = nccl_time(AR, 16, nbytes, cat.intra, cat.inter, nodes=2) \
            + step_local_seconds(AR, nbytes, 16, False, prog.tensor, cat)
        if len(prog.forward) > 1:  # a chain: strictly cheaper than the one AllReduce
            assert prog.forward_seconds < single
        else:
            assert prog.forward_seconds == pytest.approx(single)
    # large: a reduce-scatter then gathers inside the node (NVLink) beats moving all of
    # it at the inter-node bus bandwidth
    big = _program(cat, 2**28)
    assert [c.kind for c in big.forward][0] is CollectiveKind.REDUCE_SCATTER
    assert big.forward_seconds < nccl_time(AR, 16, 2**28, cat.intra, cat.inter, nodes=2) \
        + step_local_seconds(AR, 2**28, 16, False, big.tensor, cat)


@pytest.mark.parametrize("cap", [0.0, 4096.0, 25 * 2**20])
def test_bucketed_gradients_under_nccl_price_close_to_the_ilp_objective(cap):
    """The ILP's bucket term (a latency per chunk, each op's bytes at its own rate) is exact
    for affine prices; under NCCL's min(ring, tree) it is exact where an op's gradient and
    its chunk take the same algorithm, and close otherwise (cost model docstring)."""
    graph = models.gpt(hidden=32, layers=2, heads=4, seq_len=8, vocab=64, batch=4)
    cluster = catalogue_cluster("a100-80gb", 2, 2, "nvlink3", "ib-hdr200", dtype="float32")
    gp = build_problem(graph, cluster, 2, 2, MemorySpec.preset("adam"), tie_layers=True,
                       grad_bucket_bytes=cap)
    rng = np.random.default_rng(1)
    for _ in range(6):
        choice = [int(rng.integers(len(c))) for c in gp.problem.cost]
        _, cost = realise(gp, choice)
        assert cost.total_s == pytest.approx(gp.problem.objective(choice),
                                             rel=1e-9 if cap < 2**20 else 1e-3)


def test_nccl_programs_are_the_cheapest_under_their_model_and_issue_fewer_calls(monkeypatch):
    """Over the sample the gloo check runs (below), the catalogue cluster's programs are
    never dearer under the NCCL model than the ring model's programs priced the same way,
    many differ, and together they issue fewer collective calls."""
    from tests.helpers.redistribute_check import cases, setting

    ring, facts, shapes = setting(8)
    monkeypatch.setenv("CATALOGUE_CLUSTER", "1")
    cat = setting(8)[0]

    def nccl_price(red) -> float:
        return _as_nccl(red, cat)

    calls = {"ring": 0, "nccl": 0}
    differ = 0
    for i, (shape, src, dst) in enumerate(cases(facts, shapes)):
        tensor = TensorSpec(shape, "float32")
        if i % 211:
            continue
        try:
            a, b = (plan_redistribution(src, dst, tensor, c) for c in (ring, cat))
        except LayoutError:
            continue
        assert b.seconds == pytest.approx(nccl_price(b))
        assert b.seconds <= nccl_price(a) * (1 + 1e-9), (src, dst)
        calls["ring"] += len(a.forward + a.backward)
        calls["nccl"] += len(b.forward + b.backward)
        differ += [c.kind for c in a.forward + a.backward] != [c.kind for c in b.forward + b.backward]
    assert differ > 50 and calls["nccl"] < calls["ring"], (differ, calls)


# -- executed as planned ------------------------------------------------------------------------


@pytest.mark.slow
def test_nccl_model_programs_run_on_gloo_and_give_the_unsharded_values(monkeypatch):
    """The redistribution programs the NCCL model picks on a catalogue 2 × 4 cluster (one
    AllReduce where the ring model would chain; the local kernels around the calls priced)
    run forward and backward on 8 gloo processes: every rank holds the block of the
    unsharded tensor and dispatches the local kernels the lowering prices."""
    monkeypatch.setenv("CASE_STRIDE", "211")
    monkeypatch.setenv("CATALOGUE_CLUSTER", "1")
    monkeypatch.setenv("COUNT_KERNELS", "1")
    res = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "8",
               str(ROOT / "tests" / "helpers" / "redistribute_check.py")], timeout=300)
    lines = [x for x in res.stdout.splitlines() if x.startswith(("OK", "BAD", "cases"))]
    assert res.returncode == 0, "\n".join(x for x in lines if not x.startswith("OK"))[-3000:]
    assert lines[-1].endswith("bad 0") and int(lines[-1].split()[1]) > 200


@pytest.mark.slow
def test_catalogue_plan_runs_audited_under_torchrun(tmp_path):
    """A plan priced with the NCCL model (catalogue names, 2 nodes × 2) runs under torchrun:
    the collectives executed equal the planned ones, and it trains like one process."""
    raw = copy.deepcopy(load_config(ROOT / "configs" / "tiny-gpt-cpu.yaml").raw)
    raw["cluster"] = {"gpu": "a100-80gb", "nodes": 2, "devices_per_node": 2,
                      "intra": "nvlink3", "inter": "ib-hdr200"}
    plan = solve(parse_config(raw), baselines=False)
    assert parse_config(plan.config).cluster.collectives == "nccl"
    plan.save(tmp_path / "cat.json")
    res = run([sys.executable, "-m", "ilp_planner.cli", "run", str(tmp_path / "cat.json"),
               "--nproc-per-node", "4", "--steps", "2", "--quiet", "--audit",
               "--check-reference", "--results", str(tmp_path / "r.json")], timeout=300)
    assert res.returncode == 0, f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    (result,) = json.loads((tmp_path / "r.json").read_text())
    assert result["audit_ok"] is True
    assert "MISMATCH" not in res.stdout
    assert math.isfinite(plan.step_s)
