"""``benchmarks/published_runs.py``'s fixed parts: every ``configs/published/*.yaml`` loads
with the published configuration as a compare entry that resolves for its model and
cluster, each row has its config and the config its row, and the FLOP count is the
sources' (a row computed by hand, and the pricing module's own count with every block
recomputed). No timing, no solve."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from ilp_planner.inputs.config import load_config
from ilp_planner.inter_op.given_price import model_flops
from ilp_planner.inter_op.given_rival import mesh_out_of_space, out_of_space
from ilp_planner.inter_op.layer_units import layer_units
from ilp_planner.ir.cluster import submesh_shapes

ROOT = Path(__file__).resolve().parent.parent
_SPEC = importlib.util.spec_from_file_location("published_runs",
                                               ROOT / "benchmarks" / "published_runs.py")
assert _SPEC is not None and _SPEC.loader is not None
published_runs = importlib.util.module_from_spec(_SPEC)
sys.modules["published_runs"] = published_runs  # its dataclasses look their module up
_SPEC.loader.exec_module(published_runs)
CONFIGS = sorted((ROOT / "configs" / "published").glob("*.yaml"))


def test_every_row_has_its_config_and_every_config_its_row() -> None:
    assert {r.config for r in published_runs.ROWS} == {p.stem for p in CONFIGS}
    assert len(CONFIGS) == 17


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_published_config_loads_and_its_compare_entry_resolves(path: Path) -> None:
    config = load_config(path)
    assert config.name == path.stem
    m = config.model
    assert (m["kind"], m["vocab"]) == ("gpt", 51200)
    if path.stem.startswith("megatron"):
        # Table 1: Selene, seq 2048, bf16, the row's TP × PP × DP on every GPU
        assert (config.cluster.device.name, m["seq_len"], m["dtype"]) == ("a100-80gb", 2048,
                                                                          "bfloat16")
        (g,) = config.compare
        assert g.tp * g.pp * g.dp == config.cluster.num_devices
        assert g.recompute == "full" and m["layers"] % (g.pp * g.vpp) == 0
    else:
        assert (config.cluster.device.name, m["seq_len"], m["batch"], m["dtype"]) == (
            "v100-16gb", 1024, 1024, "float16")
        assert len(config.compare) <= 1
    assert config.cluster.device.fit.attention == "unfused"


def test_flop_formula_against_a_hand_computed_row() -> None:
    """Megatron 1.7B: 96 · 512 · 2048 · 24 · 2304² · (1 + 2048/13824 + 51200/884736)."""
    hand = 96 * 512 * 2048 * 24 * 2304**2 * (1 + 2048 / 13824 + 51200 / 884736)
    assert hand == pytest.approx(1.54668e16, rel=1e-5)
    assert published_runs.published_flops(512, 2048, 24, 2304, 51200) == pytest.approx(hand)
    config = load_config(ROOT / "configs" / "published" / "megatron-1.7b-32.yaml")
    assert published_runs.config_flops(config) == pytest.approx(hand)
    # the pricing module's count with every block recomputed is the same formula
    assert model_flops(config, 24) == pytest.approx(hand)
    # 137 TFLOP/s per GPU on 32 GPUs is a step of hand / (137e12 · 32) seconds
    step = hand / (137e12 * 32)
    assert published_runs.tflops_per_gpu(config, step) == pytest.approx(137)


def test_megatron_candidates_respect_the_engine() -> None:
    """The search space of rows without a published configuration: TP within a node, the
    degrees' product the device count; the config refuses what Megatron refuses."""
    config = load_config(ROOT / "configs" / "published" / "alpa-39b-64.yaml")
    texts = published_runs.megatron_candidates(config)
    valid = published_runs._valid(config, texts)
    assert valid and len(valid) < len(texts)
    assert all(g.tp <= 8 and g.tp * g.pp * g.dp == 64 for g in valid)
    assert all(48 % g.pp == 0 and 64 % g.tp == 0 for g in valid)


def test_the_fitted_constant_scales_every_devices_matmul_efficiency_alone() -> None:
    """``--matmul-scale``: e_max × the constant, every other roofline figure the catalogue's."""
    for row in (published_runs.ROWS[0], published_runs.ROWS[-1]):
        base = published_runs.load_row(row, None).cluster.device
        scaled = published_runs.load_row(row, 0.8).cluster.device
        assert scaled.fit.matmul_efficiency == pytest.approx(0.8 * base.fit.matmul_efficiency)
        assert (scaled.fit.matmul_half_dim, scaled.hbm_bytes_per_s, dict(scaled.peak_flops)) == (
            base.fit.matmul_half_dim, base.hbm_bytes_per_s, dict(base.peak_flops))


@pytest.mark.parametrize("path", [p for p in CONFIGS if p.stem.startswith("megatron")],
                         ids=lambda p: p.stem)
def test_own_plan_space_holds_the_published_stages(path: Path) -> None:
    """A pipelined row's stage DP can express the published pipeline — ``pp`` stages of
    ``nodes / pp`` whole nodes and ``layers / pp`` blocks (the even pipeline the DP prices
    first as its incumbent) — so its optimum is at least as fast under the model as that
    layout with each stage's best layouts (interleaving aside)."""
    config = load_config(path)
    (g,) = config.compare
    pipe, cluster = config.pipeline, config.cluster
    if pipe.stages == 1 or g.pp == 1:
        return
    graph = config.microbatch_graph()
    units = layer_units(graph, pipe.max_units)
    assert len(units) % g.pp == 0, f"{len(units)} units cannot make {g.pp} even stages"
    per = len(units) // g.pp
    blocks = [{graph[n].block_index for n in sum(units[i:i + per], [])} - {None}
              for i in range(0, len(units), per)]
    assert all(len(b) == config.model["layers"] // g.pp for b in blocks)
    assert cluster.nodes % g.pp == 0
    shapes = submesh_shapes(cluster.nodes, cluster.devices_per_node, pipe.submesh_space)
    assert (cluster.nodes // g.pp, cluster.devices_per_node) in shapes


@pytest.mark.parametrize("path", [p for p in CONFIGS if p.stem.startswith("megatron")
                                  or p.stem == "alpa-350m-1"], ids=lambda p: p.stem)
def test_every_rows_published_configuration_is_offered_as_the_plans_rival(path: Path) -> None:
    """The row's published configuration is in a rival's space — pipelined (interleaving
    included; the config's micro-batch count, recomputation allowed) or on one mesh (its
    own micro-batches, the config writing none) — so the plan is never predicted slower
    than it (``ilp_planner/inter_op/given_rival.py``). The other Alpa rows' configs fix 64
    micro-batches where Megatron-LM's configuration runs 128–512: not covered."""
    config = load_config(path)
    (g,) = config.compare
    if g.pp > 1:
        assert config.pipeline.pipelined and out_of_space(config, g) is None
    else:
        assert mesh_out_of_space(config, g) is None
