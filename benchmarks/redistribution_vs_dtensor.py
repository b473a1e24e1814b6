"""The lowered redistribution programs against what ``DTensor.redistribute`` executes.

For every pair of placements (``S(d)`` per dim, ``B``, ``P`` per mesh axis) on the meshes
(8,), (2, 4), (4, 2), (2, 2, 2) of the 2 × 4 cluster of ``configs/gpt-2.6b-2x4.yaml``
(NVLink 1200 Gb/s, 5 µs inside a node; 10 Gb/s, 10 µs between), for the shapes the tests use
(1024 × 4096 and 8 × 512 × 1024 fp32, uneven 1023 × 4093 and 12 × 510 × 1021): the α–β
seconds (forward + backward) of the planner's lowered program, and of the collectives
DTensor issues for the same pair — recorded on torch's fake process group at dispatch level
(forward, then autograd's backward with the gradient in the placements ``to_local`` hands
back), priced by the same cost model (:mod:`runtime.fidelity`). DTensor runs under
``FakeTensorMode`` (shapes only). (2, 2, 2) has 64² and 125² pairs: a deterministic
stratified sample of ``--budget`` pairs per shape.

Columns: pairs the lowering offers (those DTensor also runs); the sums of both prices and
their ratio; how many pairs are cheaper (<), equal (=) or dearer (>) planned; the pairs
the lowering refuses because the destination has a partial sum the source lacks (DTensor
runs the B→P ones as a local split and raises on S→P).

Bytes are the α–β *n* per rank (the tensor for AllReduce, the gathered output for
AllGather, the input for ReduceScatter and AllToAll), padded as executed: DTensor pads per
group to its largest chunk, the runtime to the layout's largest block. Rank 0 holds the
largest chunk on every axis, so its record is DTensor's slowest group; ``--ranks 0,5``
records a second rank and reports whether any of its collectives is larger.

Run: ``python benchmarks/redistribution_vs_dtensor.py [--budget 1000] [--ranks 0]``.
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings

from ilp_planner.ir.cluster import Cluster, Factorisation, Link, MeshAxis
from ilp_planner.ir.graph import TensorSpec
from ilp_planner.ir.layouts import Layout, Partial
from ilp_planner.lowering.redistribution import plan_redistribution
from runtime.fidelity import Recorded, critical, device_mesh, fake_world, placement_pairs, record_dtensor
from runtime.recorder import Recorder

CLUSTER = Cluster(2, 4, 16 * 2**30, 1.25e14, Link.from_bandwidth(5, 1200), Link.from_bandwidth(10, 10))
MESHES: dict[str, Factorisation] = {
    "(8,)": (MeshAxis(2, 4),),
    "(2,4)": (MeshAxis(2, 1), MeshAxis(1, 4)),
    "(4,2)": (MeshAxis(2, 2), MeshAxis(1, 2)),
    "(2,2,2)": (MeshAxis(2, 1), MeshAxis(1, 2), MeshAxis(1, 2)),
}
SHAPES = [(1024, 4096), (1023, 4093), (8, 512, 1024), (12, 510, 1021)]
REL = 1e-9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=int, default=1000, help="pairs per (mesh, shape) at most")
    ap.add_argument("--ranks", default="0", help="ranks to record DTensor on, comma-separated")
    args = ap.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    warnings.simplefilter("ignore")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

    cases = []  # (mesh, shape, src, dst, program)
    refused: dict[tuple[str, tuple], int] = {}
    for name, fact in MESHES.items():
        for shape in SHAPES:
            tensor = TensorSpec(shape)
            for sp, dp in placement_pairs(len(fact), len(shape), args.budget):
                src, dst = Layout(fact, sp), Layout(fact, dp)
                if any(isinstance(p, Partial) and not isinstance(sp[i], Partial) for i, p in enumerate(dp)):
                    refused[(name, shape)] = refused.get((name, shape), 0) + 1
                    continue
                cases.append((name, shape, src, dst, plan_redistribution(src, dst, tensor, CLUSTER)))

    t0 = time.perf_counter()
    records: list[list[Recorded]] = [[] for _ in cases]
    for rank in ranks:
        with fake_world(rank, CLUSTER.num_devices):
            meshes = {name: device_mesh(fact, range(CLUSTER.num_devices)) for name, fact in MESHES.items()}
            recorder = Recorder(CLUSTER.devices_per_node)
            for i, (name, _, src, dst, red) in enumerate(cases):
                records[i].append(record_dtensor(meshes[name], src, dst, red.tensor, recorder,
                                                 fake_tensors=True))
    wall = time.perf_counter() - t0

    header = (f"{'mesh':8} {'shape':15} {'pairs':>6} {'planned s':>11} {'DTensor s':>11} {'ratio':>6} "
              f"{'<':>5} {'=':>5} {'>':>3} {'refused':>8}")
    print(header)
    print("-" * len(header))
    total = [0, 0.0, 0.0, 0, 0, 0, 0]
    rank0_not_slowest = 0
    for name in MESHES:
        for shape in SHAPES:
            rows = [(red, records[i]) for i, (n, s, _, _, red) in enumerate(cases) if (n, s) == (name, shape)]
            planned = theirs = 0.0
            lt = eq = gt = 0
            for red, recs in rows:
                dt = critical(recs)
                rank0_not_slowest += dt != recs[0]
                p, d = red.seconds, dt.seconds(CLUSTER)
                planned += p
                theirs += d
                lt += p < d * (1 - REL)
                gt += p > d * (1 + REL)
                eq += abs(p - d) <= d * REL
            ref = refused.get((name, shape), 0)
            print(f"{name:8} {'x'.join(map(str, shape)):15} {len(rows):>6} {planned:>11.4f} {theirs:>11.4f} "
                  f"{planned / theirs:>6.3f} {lt:>5} {eq:>5} {gt:>3} {ref:>8}")
            for k, v in enumerate((len(rows), planned, theirs, lt, eq, gt, ref)):
                total[k] += v
    print("-" * len(header))
    print(f"{'all':8} {'':15} {total[0]:>6} {total[1]:>11.4f} {total[2]:>11.4f} {total[1] / total[2]:>6.3f} "
          f"{total[3]:>5} {total[4]:>5} {total[5]:>3} {total[6]:>8}")
    if len(ranks) > 1:
        print(f"pairs where a rank other than {ranks[0]} issued a larger collective: {rank0_not_slowest}")
    print(f"DTensor recorded on rank(s) {ranks} in {wall:.0f} s")


if __name__ == "__main__":
    main()
