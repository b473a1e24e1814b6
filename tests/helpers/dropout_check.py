"""torchrun script (4 ranks): dropout under ``parallelize`` draws what one process draws.

    torchrun --nproc-per-node 4 tests/helpers/dropout_check.py

A small transformer block with dropout everywhere a user writes it — ``nn.Dropout`` on a
column-split activation and in place on a row-parallel projection's output, SDPA's
``dropout_p`` on heads split over one axis and the batch over the other — is planned in
Megatron's layouts on 2 × 2 devices and trained 3 steps beside one process drawing from the
same generator: the losses and the parameters must agree and the audit must match the plan.
Then three refusals: ranks whose generators differ (``parallelize`` names them) and a random
op on a DTensor other than a dropout (its first forward names it); and ranks whose modules
were built apart (``parallelize`` names the first value that differs). Prints ``OK <check>``
or ``FAIL <check>: <why>`` per check on rank 0 and exits 1 on any failure."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ilp_planner  # noqa: E402
from ilp_planner.inputs.config import load_config  # noqa: E402
from ilp_planner.intra_op.baselines import megatron_filter  # noqa: E402
from ilp_planner.ir.cluster import MeshAxis  # noqa: E402
from ilp_planner.plan.data import Plan  # noqa: E402
from ilp_planner.testing import restricted_plan  # noqa: E402
from runtime.apply import audit, full_value, parallelize  # noqa: E402
from runtime.errors import FidelityError, RuntimeSetupError  # noqa: E402
from runtime.recorder import Recorder  # noqa: E402

HEADS, WIDTH = 2, 16


class Noise(nn.Module):
    """Adds uniform noise: a random op on whatever layout the plan gives its input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand_like(x)


class Block(nn.Module):
    """Attention (SDPA dropping its probabilities) and an MLP with two dropouts; ``noise``
    adds ``rand_like`` of the MLP's hidden value (a random op no plan runs as one process)."""

    def __init__(self, p: float, noise: bool = False):
        super().__init__()
        self.p, self.noise = p, noise
        self.q, self.k, self.v = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.o = nn.Linear(WIDTH, WIDTH)
        self.up, self.down, self.head = (nn.Linear(WIDTH, 2 * WIDTH),
                                         nn.Linear(2 * WIDTH, WIDTH), nn.Linear(WIDTH, 4))
        # the output's in place (a linear's output: nothing saved for its backward)
        self.drop_hidden, self.drop_out = nn.Dropout(p), nn.Dropout(p, inplace=True)
        self.add_noise = Noise()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (lin(x).view(b, t, HEADS, WIDTH // HEADS).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0,
                                             is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, t, WIDTH))
        h = torch.relu(self.up(x))
        if self.noise:
            h = self.add_noise(h)
        return self.head(x + self.drop_out(self.down(self.drop_hidden(h))))


def cluster(world: int) -> dict:
    return {"nodes": 1, "devices_per_node": world, "memory_gib": 16, "peak_tflops": 1,
            "links": {"intra": {"latency_us": 1, "bandwidth_gbps": 10},
                      "inter": {"latency_us": 1, "bandwidth_gbps": 10}}}


def megatron_plan(model: nn.Module, x: torch.Tensor) -> Plan:
    """Megatron's layouts on 2 × 2 (data × tensor parallel), solved on rank 0."""
    box = [None]
    if dist.get_rank() == 0:
        graph = ilp_planner.from_module(model, (x,))
        config = load_config({"model": graph, "cluster": cluster(dist.get_world_size())})
        box = [restricted_plan(config, megatron_filter(MeshAxis(1, 2), MeshAxis(1, 2))).to_dict()]
    dist.broadcast_object_list(box, src=0)
    return Plan.from_dict(box[0])


def trains_like_one_process() -> list[str]:
    """3 steps against one process drawing from the same generator state."""
    torch.manual_seed(0)
    model, x, y = Block(0.3), torch.randn(4, 6, WIDTH), torch.randint(0, 4, (4, 6))
    reference = copy.deepcopy(model)
    plan = megatron_plan(model, x)
    model = parallelize(plan, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    failures = []
    for step in range(3):
        drawn = torch.get_rng_state()
        rec = Recorder(dist.get_world_size())
        with rec:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad()
        torch.set_rng_state(drawn)
        ref = F.cross_entropy(reference(x).flatten(0, 1), y.flatten())
        ref.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mine = float(full_value(loss))
        if abs(mine - float(ref)) > 1e-5 * max(1.0, abs(float(ref))):
            failures.append(f"step {step}: loss {mine} vs one process {float(ref)}")
        if not all(r.ok for r in audit(plan, dist.get_rank(), rec.events)):
            failures.append(f"step {step}: the audit differs from the plan")
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        if not torch.allclose(full_value(p.detach()), q.detach(), atol=1e-5):
            failures.append(f"parameter {name} differs from one process's")
    split = {ly.name: ly.strategy for ly in plan.layers}
    if split.get("attention") != "S(0)S(1)":
        failures.append(f"the plan does not split the attention's batch and heads: {split}")
    return failures


def refuses_generators_apart() -> list[str]:
    """Ranks seeded apart: ``parallelize`` refuses, naming the ranks."""
    torch.manual_seed(0)
    model, x = Block(0.3), torch.randn(4, 6, WIDTH)
    plan = megatron_plan(model, x)
    torch.manual_seed(1 + dist.get_rank())
    try:
        parallelize(plan, model)
    except RuntimeSetupError as exc:
        return [] if "rank(s) 1, 2, 3 from rank 0" in str(exc) else [f"wrong refusal: {exc}"]
    return ["parallelize accepted ranks whose generators differ"]


def refuses_modules_apart() -> list[str]:
    """Modules built after seeding each rank apart: ``parallelize`` refuses, naming the
    first value that differs and the ranks (it kept each rank's own block before)."""
    torch.manual_seed(0)
    x = torch.randn(4, 6, WIDTH)
    plan = megatron_plan(Block(0.0), x)
    torch.manual_seed(1 + dist.get_rank())
    model = Block(0.0)
    try:
        parallelize(plan, model)
    except RuntimeSetupError as exc:
        want = "rank(s) 1, 2, 3 from rank 0, first in 'q.weight'"
        return [] if want in str(exc) else [f"wrong refusal: {exc}"]
    return ["parallelize accepted ranks whose modules differ"]


def refuses_other_random_ops() -> list[str]:
    """``rand_like`` of a split DTensor: refused at the forward, naming it."""
    torch.manual_seed(0)
    model, x = Block(0.0, noise=True), torch.randn(4, 6, WIDTH)
    plan = megatron_plan(model, x)
    model = parallelize(plan, model)
    try:
        model(x)
    except FidelityError as exc:
        return [] if "rand_like draws random values on a DTensor" in str(exc) else [
            f"wrong refusal: {exc}"]
    return ["rand_like on a DTensor ran"]


def main() -> int:
    dist.init_process_group("gloo")
    failed = 0
    for check in (trains_like_one_process, refuses_generators_apart, refuses_modules_apart,
                  refuses_other_random_ops):
        failures = check()
        flag = torch.tensor([len(failures)])
        dist.all_reduce(flag)
        if failures:
            print(f"FAIL {check.__name__} (rank {dist.get_rank()}): " + "; ".join(failures),
                  flush=True)
        elif dist.get_rank() == 0 and int(flag) == 0:
            print(f"OK {check.__name__}", flush=True)
        failed += int(flag)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
