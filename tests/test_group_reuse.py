"""A process applying plans again reuses its process groups (:func:`runtime.mesh.world_cache`):
each gloo group keeps threads and sockets until the process ends, and a new set per plan had
grown to a thousand threads per rank over the Hugging Face harness's 69 models. Checked on
a fake 8-rank world in one process."""

from __future__ import annotations

from ilp_planner.ir.cluster import MeshAxis
from ilp_planner.ir.layouts import B, Layout, Split
from runtime.dtensors import Meshes
from runtime.fidelity import fake_world
from runtime.mesh import MeshRegistry

DEVICES = tuple(range(8))
FACT = (MeshAxis(2, 1), MeshAxis(1, 4))


def _registry(extra: tuple | None = None) -> MeshRegistry:
    registry = MeshRegistry(60)
    registry.need_mesh(DEVICES, FACT)
    if extra is not None:
        registry.need_group(extra, (0, 1, 2, 3))
    registry.create()
    return registry


def test_a_second_plan_reuses_the_groups_and_meshes_of_the_first():
    """The same key and ranks give the same group to a later registry; another key over
    the same ranks (a transfer direction, kept apart on purpose) its own; a later
    ``Meshes`` the same DeviceMesh. A new default group starts afresh."""
    lay = Layout(FACT, (Split(0), B))
    with fake_world(0, len(DEVICES)):
        first, second = _registry(("fwd", 0)), _registry(("fwd", 0))
        line = ("mesh", (0, 1, 2, 3))
        assert first.group(line) is second.group(line)
        assert first.group(("fwd", 0)) is second.group(("fwd", 0))
        assert first.group(("fwd", 0)) is not first.group(line)
        assert Meshes([lay], "cpu", 8).of(lay) is Meshes([lay], "cpu", 8).of(lay)
        old, old_mesh = first.group(line), Meshes([lay], "cpu", 8).of(lay)
    with fake_world(0, len(DEVICES)):
        assert _registry().group(line) is not old
        assert Meshes([lay], "cpu", 8).of(lay) is not old_mesh
