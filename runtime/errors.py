"""Runtime errors: typed, so launchers can tell a bad plan from a failed run."""

from __future__ import annotations

from ilp_planner.errors import PlannerError


class RuntimeSetupError(PlannerError):
    """The plan cannot run here: world size, op kinds, layouts the runtime does not support."""


class ScheduleError(PlannerError):
    """A pipeline schedule's action list is malformed (unknown kind, missing micro-batch)."""


class FidelityError(PlannerError):
    """What ran differs from what the plan priced: a placement DTensor chose that the plan
    does not have, or a gradient that skipped its planned reduction."""


class RunFailedError(PlannerError):
    """A rank of a launched run failed: the message names the rank, the cause and the log
    that holds its traceback."""
