"""SGD and Adam as elementwise updates on plain tensors.

Both updates are elementwise, so applying them to each rank's local shard of a parameter
(with the synchronised gradient shard) gives exactly the shards of the update applied to
the full tensor — the executor and the single-process reference share this code::

    SGD:   p ← p − lr·g
    Adam:  m ← β1·m + (1−β1)·g,   v ← β2·v + (1−β2)·g²,
           p ← p − lr · (m / (1−β1ᵗ)) / (√(v / (1−β2ᵗ)) + ε)      (t = 1, 2, …)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ilp_planner.errors import ConfigError

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
        self.t = 0
        self.state: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def step(self, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> None:
        s = self.spec
        self.t += 1
        if s.name == "sgd":
            torch._foreach_add_(list(params.values()), [grads[k] for k in params], alpha=-s.lr)
            return
        for name, p in params.items():
            g = grads[name]
            m, v = self.state.get(name) or (torch.zeros_like(p), torch.zeros_like(p))
            m.mul_(s.beta1).add_(g, alpha=1 - s.beta1)
            v.mul_(s.beta2).addcmul_(g, g, value=1 - s.beta2)
            self.state[name] = (m, v)
            m_hat = m / (1 - s.beta1 ** self.t)
            v_hat = v / (1 - s.beta2 ** self.t)
            p.sub_(s.lr * m_hat / (v_hat.sqrt() + s.eps))
