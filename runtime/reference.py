"""The single-process, unsharded run a distributed run must reproduce: the same graph,
initial parameters, data, micro-batching (the loss of each micro-batch scaled by 1/M and
gradients accumulated) and optimizer. Returns the loss of every step and the final
parameters, keyed like :func:`runtime.model.graph_param_specs`.

Comparing under Adam (:func:`compare`). Adam maps a gradient g to about ±lr·g/|g|, so an
element whose gradient is zero in exact arithmetic but rounding noise in floating point
(GPT's key biases: softmax is invariant to them, their gradient is ~1e-10) takes an O(lr)
step of random sign — in the reference and in any other summation order alike. Such an
element's value is not determined by the computation, so no tolerance can compare it; the
reference marks, per parameter, the elements whose gradient stayed within the rounding
floor (``NOISE_FLOOR`` of the compute dtype × the step's largest gradient entry) in every
step without being exactly zero in all of them (an exactly-zero gradient, e.g. a dead ReLU unit's, is zero in
any summation order and gives a zero step, so it is compared), and the comparison leaves
exactly those out (and says how many). Every other element, and every
loss, is compared at the same tolerance as under SGD — but for Adam in a half dtype.

There the rounding is not confined to near-zero gradients: a gradient that is a sum with
cancellation (an embedding row's over its tokens, a norm's bias) carries an error of the
size of its terms, and Adam's step of ±lr takes its sign. Two runs of the same training
differing only in summation order then drift apart by about as far as either is from the
same training in float32 (tiny GPT in bfloat16, two Adam steps at lr 1e-2: 4.4e-2 of the
position table's norm between one micro-batch and two, the reference 2.4e-2 from float32).
So the reference also trains with float32 gradients from the same masters and measures,
per parameter, its own drift from that run (``ReferenceResult.drift``); a parameter of a
distributed run is equivalent when within ``DRIFT_MULTIPLE`` × that drift (or the dtype's
tolerance, if larger). Two independent summation orders sit about √2 × the drift apart; a
wrong program — a gradient missing a rank's share — moves whole fractions of the step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ilp_planner.ir.graph import Graph, OpKind
from ilp_planner.lowering.moe_strategies import moe_param_shapes
from runtime import model, moe
from runtime.optim import Optimizer, OptimizerSpec

# Rounding floor per compute dtype, relative to the step's largest gradient entry: a gradient
# that is zero in exact arithmetic (GPT's key biases) measures ≤ 4e-9 in float32 and ≤ 7e-5
# in bfloat16 on tiny GPT; each floor leaves an order of magnitude above the noise, and
# float16 (8× finer than bfloat16) sits in between.
NOISE_FLOOR = {torch.float32: 1e-6, torch.bfloat16: 1e-3, torch.float16: 1e-4}
# Adam in a half dtype: how far a parameter may be from the reference, in multiples of the
# reference's own drift from its float32-gradient twin (module docstring)
DRIFT_MULTIPLE = 2.0
# Equivalence tolerance per compute dtype (relative: losses, and parameters norm-wise). The
# half types differ from the reference by their summation order's rounding: tiny GPT on 8
# ranks (3 SGD steps, lr 0.1) measures 1.0e-4 / 3.1e-3 (loss / worst parameter) in bfloat16
# and 2.7e-5 / 4.4e-4 in float16 — a few times below these. Under Adam a half-precision run
# does not reproduce the parameters (every element whose gradient is small steps ±lr with
# the sign of its rounding: 3.9e-2 at lr 1e-2 in bfloat16, as far as bfloat16 is from
# float32 itself); its losses still match, and its parameters are compared against that
# drift (DRIFT_MULTIPLE).
RTOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def tolerance(graph: Graph) -> float:
    """The relative tolerance a run of ``graph`` is compared with."""
    return RTOL[model.compute_dtype(graph)]


@dataclass(frozen=True)
class ReferenceResult:
    losses: list[float]
    params: dict[str, torch.Tensor]
    undetermined: dict[str, torch.Tensor]  # Adam: elements whose value is rounding noise
    # Adam in a half dtype: each parameter's norm-wise relative distance (determined
    # elements) from the same training with float32 gradients; empty otherwise
    drift: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Comparison:
    loss_rel_err: float
    param_rel_err: float
    worst_param: str
    param_rel_errs: dict[str, float]
    undetermined_elements: int
    drift: dict[str, float] = field(default_factory=dict)  # ReferenceResult.drift

    def allowed(self, name: str, rtol: float, drift: bool = True) -> float:
        """A parameter's tolerance: ``rtol``, or where the reference measured its drift
        (Adam in a half dtype) and ``drift`` allows it, :data:`DRIFT_MULTIPLE` × that
        drift if larger (a tolerance the user named is taken as it is)."""
        return max(rtol, DRIFT_MULTIPLE * self.drift.get(name, 0.0) if drift else 0.0)

    def nearest(self, rtol: float, drift: bool = True) -> str:
        """The parameter closest to (or furthest past) its tolerance."""
        return max(self.param_rel_errs,
                   key=lambda k: self.param_rel_errs[k] / self.allowed(k, rtol, drift))

    def ok(self, rtol: float, drift: bool = True) -> bool:
        return self.loss_rel_err <= rtol and all(
            err <= self.allowed(k, rtol, drift) for k, err in self.param_rel_errs.items())

    def to_dict(self) -> dict:
        return {"loss_rel_err": self.loss_rel_err, "param_rel_err": self.param_rel_err,
                "worst_param": self.worst_param, "param_rel_errs": self.param_rel_errs,
                "undetermined_elements": self.undetermined_elements, "drift": self.drift}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error of ``a`` against ``b``."""
    a, b = a.detach().double(), b.detach().double()
    den = float(torch.linalg.vector_norm(b))
    num = float(torch.linalg.vector_norm(a - b))
    return num / den if den > 0 else num


def compare(losses: list[float], params: dict[str, torch.Tensor], ref: ReferenceResult) -> Comparison:
    """A distributed run against the reference: worst relative loss error over the steps,
    norm-wise relative error per parameter over its determined elements."""
    loss_err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref.losses, strict=True))
    perr = {}
    for k, want in ref.params.items():
        keep = ~ref.undetermined[k]
        perr[k] = rel_err(params[k][keep], want[keep])
    worst = max(perr, key=perr.get)
    return Comparison(loss_err, perr[worst], worst, perr,
                      int(sum(int(m.sum()) for m in ref.undetermined.values())), ref.drift)


def forward(graph: Graph, params: dict[str, torch.Tensor], data: dict[str, torch.Tensor]) -> torch.Tensor:
    """Loss of one (micro-)batch: the graph's ops run on full tensors in order."""
    vals: dict[str, torch.Tensor] = {}
    loss = None
    for op in graph.ops:
        k = op.kind
        xs = [vals[i] for i in op.inputs]
        if k is OpKind.INPUT:
            y = data[op.name]
        elif k is OpKind.LINEAR:
            if op.attrs.get("tied"):
                w = params[f"{model.tied_source(graph, op).name}.weight"].t()
            else:
                w = params[f"{op.name}.weight"]
            y = model.linear(xs[0], w, params.get(f"{op.name}.bias"))
        elif k is OpKind.EMBEDDING:
            y = model.embedding(xs[0], params[f"{op.name}.weight"])
            if "seq_len" in op.attrs:
                y = y + params[f"{op.name}.pos"][model.positions(0, y.shape[0], op.attr("seq_len"))]
        elif k is OpKind.LAYERNORM:
            y = model.layer_norm(xs[0], params[f"{op.name}.weight"], params[f"{op.name}.bias"])
        elif k is OpKind.RMSNORM:
            y = model.rms_norm(xs[0], params[f"{op.name}.weight"])
        elif k is OpKind.ATTENTION:
            y = model.attention(xs[0], op.attr("heads"), op.attr("seq_len"),
                                op.attrs.get("rope_theta", 0), op.attrs.get("kv_heads", 0))
        elif k is OpKind.ADD:
            y = xs[0] + xs[1]
        elif k is OpKind.MUL:
            y = xs[0] * xs[1]
        elif k is OpKind.CONV2D:
            y = model.conv2d(xs[0], params[f"{op.name}.weight"], params[f"{op.name}.bias"])
        elif k is OpKind.POOL:
            y = model.max_pool(xs[0], op.attr("kernel"))
        elif k is OpKind.FLATTEN:
            y = model.flatten(xs[0])
        elif k is OpKind.MOE:
            y = moe.reference(op, xs[0], {r: params[f"{op.name}.{r}"] for r in
                                          moe_param_shapes(op)})
        elif k in model.ELEMENTWISE:
            y = model.ELEMENTWISE[k](xs[0])
        elif k is OpKind.LOSS:
            y = model.cross_entropy(xs[0], data[model.targets_key(op.name)])
            loss = y if loss is None else loss + y
        else:  # check_supported ran first
            raise AssertionError(k)
        vals[op.name] = y
    assert loss is not None, "graph has no loss op"
    return loss


def run_reference(graph: Graph, *, steps: int, seed: int, optimizer: OptimizerSpec,
                  microbatches: int = 1) -> ReferenceResult:
    """Train ``steps`` optimizer steps of the full-batch ``graph`` on one process (Adam in a
    half dtype: twice, the second with float32 gradients, for the drift)."""
    model.check_supported(graph)
    dtype = model.compute_dtype(graph)
    ref = _train(graph, steps, seed, optimizer, microbatches, dtype)
    if optimizer.name != "adam" or dtype == torch.float32:
        return ref
    twin = _train(graph, steps, seed, optimizer, microbatches, torch.float32)
    drift = {k: rel_err(p[~ref.undetermined[k]], twin.params[k][~ref.undetermined[k]])
             for k, p in ref.params.items()}
    return ReferenceResult(ref.losses, ref.params, ref.undetermined, drift)


def _train(graph: Graph, steps: int, seed: int, optimizer: OptimizerSpec, microbatches: int,
           dtype: torch.dtype) -> ReferenceResult:
    """:func:`run_reference`'s training, the forward and backward in ``dtype`` (float32
    masters either way; the loss scaled where the graph's dtype asks)."""
    scale = model.loss_scale(graph) if dtype != torch.float32 else 1.0
    params = {k: v.clone().requires_grad_(True) for k, v in model.init_params(graph, seed).items()}
    opt = Optimizer(optimizer)
    losses = []
    tiny = {k: torch.full_like(p, optimizer.name == "adam", dtype=torch.bool)
            for k, p in params.items()}
    nonzero = {k: torch.zeros_like(p, dtype=torch.bool) for k, p in params.items()}
    for _ in range(steps):
        for p in params.values():
            p.grad = None
        total = 0.0
        for mb in model.split_microbatches(model.make_batch(graph, seed), microbatches):
            mb = {k: v.to(dtype) if v.is_floating_point() else v for k, v in mb.items()}
            copies = {k: p.to(dtype) for k, p in params.items()}  # masters stay float32
            loss = forward(graph, copies, mb) / microbatches
            (loss * scale).backward()
            total += float(loss.detach())
        losses.append(total)
        if scale != 1.0:
            model.unscale({k: p.grad for k, p in params.items()}, scale)
        floor = NOISE_FLOOR[dtype] * max(float(p.grad.abs().max()) for p in params.values())
        for k, p in params.items():
            tiny[k] &= p.grad.abs() <= floor
            nonzero[k] |= p.grad != 0
        opt.step({k: p.data for k, p in params.items()}, {k: p.grad for k, p in params.items()})
    return ReferenceResult(losses, {k: p.detach().clone() for k, p in params.items()},
                           {k: tiny[k] & nonzero[k] for k in params})
