"""Typed exceptions. Every user-reachable failure raises one of these with a message that
says where the problem is and what to change — never a bare AssertionError."""


class PlannerError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(PlannerError):
    """A configuration file or object is malformed.

    The message names the file, the dotted key path and what was expected, e.g.
    ``configs/x.yaml: cluster.nodes: expected a positive integer, got 'two'``.
    """

    def __init__(self, message: str, *, source: str | None = None, key: str | None = None):
        self.source = source
        self.key = key
        prefix = ""
        if source:
            prefix += f"{source}: "
        if key:
            prefix += f"{key}: "
        super().__init__(prefix + message)


class LayoutError(PlannerError):
    """A layout or sharding spec is inconsistent with its mesh or tensor."""


class InfeasibleError(PlannerError):
    """No plan satisfies the constraints; the message names the binding constraint."""


class UnprovenInfeasible(InfeasibleError):
    """No plan found where none is proven not to exist: a solve stopped short (time limit)
    returned a choice the runtime cannot run, or a heuristic (the memory row's tightening)
    gave up. A search that counts proofs (the transient caps cover) must not take it for
    one."""


class PlanFormatError(PlannerError):
    """A plan file is corrupt, foreign or of an unsupported schema version."""


class BackendError(PlannerError):
    """A sweep backend cannot run: its optional package is missing, or the cluster it was
    pointed at cannot be reached."""
