"""Torch runtime: execute a solved :class:`~ilp_planner.plan.data.Plan` with ``torch.distributed``.

Modules, in the order data flows through them:

* :mod:`runtime.model` — local (single-device) kernels for every supported op kind, the
  deterministic parameter initialisation and synthetic data (both from a seed, so every rank
  and the single-process reference agree);
* :mod:`runtime.optim` — SGD and Adam as elementwise updates (identical on shards and on
  full tensors);
* :mod:`runtime.reference` — the unsharded single-process run the executor must match;
* :mod:`ilp_planner.testing` — pure helpers: unit tasks of a cross-mesh transfer, pipeline action
  lists, hand-built pipelined plans and strategy-restricted plans (tests, benchmarks);
* :mod:`runtime.mesh` — every process group of the stages' mesh axes, created in one order
  on all ranks;
* :mod:`runtime.recorder` — the dispatch-level collective recorder (``--timings``,
  ``--audit``);
* :mod:`runtime.comm` — the planner's lowered redistribution programs executed on local
  blocks (autograd functions whose backward runs the lowered backward steps);
* :mod:`runtime.fidelity` — one redistribution as it really runs, recorded on torch's fake
  process group: the runtime's execution of a lowered program and ``DTensor.redistribute``'s
  own (tests and ``benchmarks/redistribution_vs_dtensor.py``);
* :mod:`runtime.ops` — the distributed op implementations (kind → function table);
* :mod:`runtime.executor` — the facade a rank drives: a plan compiled into per-stage
  programs (:mod:`runtime.compiled`, :mod:`runtime.groups`), the schedule interpreted
  (:mod:`runtime.step_loop`, kind → handler table), cross-mesh broadcasts
  (:mod:`runtime.transfers`), gradient synchronisation (:mod:`runtime.grad_sync`,
  :mod:`runtime.zero_state`), tied weights (:mod:`runtime.tied`), optimizer step;
* :mod:`runtime.launch` — the ``torchrun`` entry point; :mod:`runtime.measure` — collective
  micro-benchmarks for ``ilp-planner calibrate --measure``.

This package is the only place that imports ``torch.distributed``.
"""
