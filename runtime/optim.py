"""SGD and Adam as elementwise updates on plain tensors.

Both updates are elementwise, so applying them to each rank's local shard of a parameter
(with the synchronised gradient shard) gives exactly the shards of the update applied to
the full tensor — the executor and the single-process reference share this code::

    SGD:   p ← p − lr·g
    Adam:  m ← β1·m + (1−β1)·g,   v ← β2·v + (1−β2)·g²,
           p ← p − lr · (m / (1−β1ᵗ)) / (√(v / (1−β2ᵗ)) + ε)      (t = 1, 2, …)

Adam runs as PyTorch's fused kernel (``torch.optim.adam.adam(fused=True)``, one pass over
every tensor: read p, g, m, v, write p, m, v), the update the compute model prices
(:func:`ilp_planner.lowering.compute_model.update_bytes_per_param`); an unfused update (a
dozen elementwise passes) moves three to four times those bytes. SGD is one foreach add.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim.adam import adam

from ilp_planner.errors import ConfigError
from runtime.errors import RuntimeSetupError

OPTIMIZERS = ("sgd", "adam")


@dataclass(frozen=True)
class OptimizerSpec:
    name: str = "adam"
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {self.name!r}; expected one of {list(OPTIMIZERS)}")
        if not self.lr > 0:
            raise ConfigError(f"learning rate must be positive, got {self.lr}")


class Optimizer:
    """Keeps per-parameter state (Adam moments) keyed by name; ``step`` updates in place."""

    def __init__(self, spec: OptimizerSpec):
        self.spec = spec
        self.state: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # m, v, t

    @torch.no_grad()
    def step(self, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> None:
        s = self.spec
        if s.name == "sgd":
            torch._foreach_add_(list(params.values()), [grads[k] for k in params], alpha=-s.lr)
            return
        if not params:
            return
        for name, p in params.items():
            if name not in self.state:
                self.state[name] = (torch.zeros_like(p), torch.zeros_like(p),
                                    torch.zeros((), dtype=torch.float32, device=p.device))
        names = list(params)
        for k in names:  # the fused kernel assumes dense tensors laid out alike (CPU: silently)
            p, g = params[k], grads[k]
            if not (p.is_contiguous() and g.is_contiguous() and p.dtype == g.dtype):
                raise RuntimeSetupError(f"Adam's fused update needs contiguous {k!r} and gradient "
                                        f"of one dtype, got {p.dtype}/{g.dtype}, contiguous "
                                        f"{p.is_contiguous()}/{g.is_contiguous()}")
        m, v, steps = (list(x) for x in zip(*(self.state[k] for k in names), strict=True))
        adam([params[k] for k in names], [grads[k] for k in names], m, v, [], steps,
             fused=True, amsgrad=False, beta1=s.beta1, beta2=s.beta2, lr=s.lr, weight_decay=0.0,
             eps=s.eps, maximize=False)
