"""A module reading its input through the user's element-wise code outside it: Granite's
``inputs_embeds * embedding_multiplier`` runs in the model's forward, between the
embedding's boundary and the first layer's norm, so the norm receives a value computed from
what the embedding's boundary handed out — converted there for the residual's functional
code — not something its own boundary could convert. The importer marks that read
functional (``attrs.functional_inputs``, :meth:`~ilp_planner.ir.graph.Op.reads_functionally`),
the planner couples it with the producer's other functional readers and prices its program
once (:mod:`ilp_planner.lowering.shared_reads`). A scaled embedding whose product runs in
its own module (Gemma's) and code between a piece of functional code and a module (no
boundary converts there) are no such read. ``parallelize`` running it is in
``tests/test_hf_parallelize.py`` (``granite``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from ilp_planner.inputs.config import load_config
from ilp_planner.inputs.importer import from_module
from ilp_planner.intra_op.baselines import solve_exact
from ilp_planner.intra_op.problem import build_problem
from ilp_planner.ir.graph import Graph, Op, OpKind
from ilp_planner.ir.layouts import drop_unit_axes
from ilp_planner.lowering.shared_reads import riders
from ilp_planner.lowering.strategies import Strategy
from ilp_planner.plan.programs import edge_programs
from ilp_planner.testing import restricted_plan
from runtime.applied_hooks import hook_table

T = pytest.importorskip("transformers")

CLUSTER = {"nodes": 2, "devices_per_node": 4, "memory_gib": 16, "peak_tflops": 10,
           "links": {"intra": {"latency_us": 5, "bandwidth_gbps": 100},
                     "inter": {"latency_us": 10, "bandwidth_gbps": 10}}}
SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
         "max_position_embeddings": 16, "use_cache": False}
EMB, NORM, ADD = "model.embed_tokens", "model.layers.0.input_layernorm", "model.layers.0.add"


def _model(name: str) -> Any:
    torch.manual_seed(0)
    return {
        "granite": lambda: T.GraniteForCausalLM(T.GraniteConfig(**SMALL,
                                                                embedding_multiplier=2.0)),
        "gemma": lambda: T.GemmaForCausalLM(T.GemmaConfig(**SMALL, head_dim=8)),
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**SMALL)),
    }[name]().eval()


def _imported(name: str) -> Graph:
    return from_module(_model(name), (torch.randint(0, 64, (2, 8)),))


@pytest.fixture(scope="module")
def granite() -> Graph:
    return _imported("granite")


def test_a_norm_reading_the_embedding_through_the_models_code_reads_it_functionally(granite):
    """Granite's first norm reads the embedding's output through the model's product: a
    functional read (input 0), one shared read with the residual add, priced on the norm
    (the first reader), the add riding on it. The product is priced once, by the norm (one
    more step than the second layer's norm, whose input no outside code touches)."""
    norm = granite[NORM]
    assert norm.attrs["functional_inputs"] == 1 and norm.reads_functionally(0)
    assert not norm.attrs.get("functional")
    assert granite.shared_reads()[EMB] == ((NORM, 0), (ADD, 0))
    assert riders(granite)[(ADD, 0)] == (NORM, 0)
    second = granite["model.layers.1.input_layernorm"]
    assert "functional_inputs" not in second.attrs
    assert norm.attrs["input_steps"] == second.attrs["input_steps"] + 1
    assert [op.name for op in granite.ops if op.attrs.get("functional_inputs")] == [NORM]


@pytest.mark.parametrize("name", ["gemma", "llama"])
def test_no_read_through_code_where_none_runs_between_two_boundaries(name):
    """Gemma scales its embeddings in the embedding's own module (before its boundary: the
    hook converts the product), Llama not at all: no op reads through outside code, the
    graphs' shared reads are those of their functional code alone."""
    graph = _imported(name)
    assert not [op.name for op in graph.ops if op.attrs.get("functional_inputs")]
    assert graph.shared_reads().get(EMB, ()) == ()


class _Outside(nn.Module):
    """Modules reading a module producer (read by functional code too, or not) and a
    functional producer through a scale run in this parent's forward; a norm scaling its
    own input inside itself."""

    class _ScalingNorm(nn.LayerNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x * 3.0)

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.first = nn.LayerNorm(16)
        self.proj = nn.Linear(16, 16)
        self.second = nn.LayerNorm(16)
        self.inner = self._ScalingNorm(16)
        self.head = nn.Linear(16, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        h = self.first(x * 2.0) + x  # a module producer: read through code by ``first``
        s = self.proj(h) + h  # functional code: no boundary converts it
        return self.head(self.inner(self.second(s * 0.5)) * 2.0)


def test_only_a_module_producers_value_read_through_outside_code_is_marked():
    """``first`` reads the embedding (a module the functional add reads too) through the
    parent's scale: marked. ``second`` reads a functional add through the parent's scale:
    the add has no boundary, so ``second``'s own program starts from what it produced — not
    marked. ``inner`` scales inside its own module: not marked. ``head`` reads ``inner`` (a
    module no functional code reads: nothing converts its output before the scale) through
    the parent's scale: not marked, its own boundary converts the product."""
    graph = from_module(_Outside(), (torch.randint(0, 64, (2, 8)),))
    marked = {op.name: op.attrs["functional_inputs"] for op in graph.ops
              if op.attrs.get("functional_inputs")}
    assert marked == {"first": 1}
    assert graph.shared_reads()["emb"] == (("first", 0), ("add", 1))
    bare = from_module(_Outside(), (torch.randint(0, 64, (2, 8)),), dtensor=False)
    assert not any(op.attrs.get("functional_inputs") for op in bare.ops)


def test_the_solved_plan_reads_the_embedding_in_one_layout_for_the_norm_and_the_residual(
        granite):
    """The norm and the add read the one value the embedding's boundary hands out: the
    optimum reads it in one layout with one gradient layout; a choice giving the norm
    another input layout than the add's costs more than any coupled choice and is named as
    unrunnable."""
    config = load_config({"model": granite, "cluster": CLUSTER})
    gp = build_problem(granite, config.cluster, 2, 4, config.memory)
    choice, objective, _ = solve_exact(gp.problem, 30.0)
    assert gp.unrunnable(choice) is None
    chosen = gp.node_choice(choice)

    def read(name: str) -> tuple:
        opt, pos = chosen[gp.owner[name]], gp.position[name]
        return drop_unit_axes(opt.inputs[pos][0]), drop_unit_axes(opt.grads[pos][0])

    assert read(NORM) == read(ADD)
    other = next(k for k, o in enumerate(gp.options[gp.owner[NORM]])
                 if drop_unit_axes(o.inputs[gp.position[NORM]][0]) != read(ADD)[0])
    broken = list(choice)
    broken[gp.group_of[gp.owner[NORM]]] = other
    assert gp.problem.objective(broken) > 1.0 > objective
    assert f"{EMB!r} feeds functional code in two layouts" in gp.unrunnable(broken)


def test_the_embeddings_boundary_converts_for_the_norm_which_checks_what_arrives():
    """``parallelize``'s hook table for a Granite plan splitting the word table's columns
    (so the norm and the residual, reading whole rows, need a program): the embedding's
    boundary runs the one priced program for both readers, and the norm's own boundary
    runs none — it checks its input arrives in the layout it reads (the product of the
    model's scale and the converted value)."""
    def columns(op: Op, s: Strategy) -> bool:
        return op.kind is not OpKind.EMBEDDING or (
            s.output.split_degree(1) > 1 and not drop_unit_axes(s.output).has_partial)

    model = _model("granite")
    graph = from_module(model, (torch.randint(0, 64, (2, 8)),))
    config = load_config({"model": graph, "cluster": {**CLUSTER, "nodes": 1}})
    plan = restricted_plan(config, columns)
    layers = {ly.name: ly for ly in plan.layers}
    programs = {(e.consumer, e.index): e.program for e in edge_programs(plan, config, graph)
                if e.role in ("edge", "shared")}
    hooks, post = hook_table(graph, layers, programs, model)
    read = layers[NORM].inputs[0]
    assert hooks[NORM].inputs[0] == (read, None, read)
    dst, red = post[EMB]
    assert red.steps and dst == read == layers[ADD].inputs[0]
    assert red is programs[(NORM, 0)]  # the priced reader's program, run once
    assert hooks[NORM].through_code == {0}  # no origin swap: the product is what it reads
