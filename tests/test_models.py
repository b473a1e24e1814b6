"""Model builders against closed forms, U-Transformer skip edges, block tying, and the
explicit-graph form."""

from __future__ import annotations

import pytest

from ilp_planner.errors import ConfigError
from ilp_planner.inputs import models
from ilp_planner.ir.graph import OpKind


@pytest.mark.parametrize("hidden,layers,seq,vocab", [(64, 2, 16, 128), (96, 3, 32, 1000),
                                                      (256, 1, 8, 50257)])
def test_gpt_params_closed_form(hidden, layers, seq, vocab):
    g = models.gpt(hidden, layers, hidden // 32 or 1, seq, vocab, batch=2)
    closed = 12 * layers * hidden**2 + 13 * layers * hidden + vocab * hidden + seq * hidden
    assert models.gpt_params_closed_form(hidden, layers, vocab, seq) == closed
    assert g.total_params == closed + 2 * hidden  # + final layernorm


@pytest.mark.parametrize("vocab", [50257, 51200])
def test_gpt3_named_sizes(vocab):
    # GPT-3 "2.6B" (the GPT-3 paper's 2.7B: L 32, h 2560) really has 2.65 B parameters, so it
    # is within 2.5 % of its name; 6.7B (L 32, h 4096) is within 1 %.
    p26 = models.gpt(2560, 32, 32, 2048, vocab, batch=1).total_params
    p67 = models.gpt(4096, 32, 32, 2048, vocab, batch=1).total_params
    assert abs(p26 / 2.6e9 - 1) < 0.025 and 2.6e9 <= p26 < 2.7e9
    assert abs(p67 / 6.7e9 - 1) < 0.01


def test_vgg13_params():
    assert models.vgg13(batch=4).total_params == 133_047_848
    convs = [op for op in models.vgg13(batch=4).ops if op.kind is OpKind.CONV2D]
    assert len(convs) == 10


def test_mlp_params_and_chain():
    dims = [32768, 16384, 4096, 2048, 512]
    g = models.mlp(dims, batch=1024)
    assert g.total_params == sum(k * n for k, n in zip(dims[:-1], dims[1:], strict=True))
    assert [op.name for op in g.ops if op.kind is OpKind.LINEAR] == ["fc1", "fc2", "fc3", "fc4"]
    assert g["fc1"].weight.shape == (32768, 16384) and g["fc4"].output.shape == (1024, 512)
    assert models.mlp([4, 3], batch=2, bias=True).total_params == 4 * 3 + 3


def test_u_transformer_skip_edges_mirror_blocks():
    layers = 6
    g = models.u_transformer(hidden=32, layers=layers, heads=4, seq_len=8, batch=2)
    skips = []
    for src, dst in g.edges():
        s, d = g[src], g[dst]
        if s.block == d.block == "u" and d.block_index - s.block_index > 1:
            skips.append((s.block_index, d.block_index))
    # Block i feeds block L-1-i for every i < L/2 - 1; the middle pair (L/2-1 → L/2) is also
    # adjacent, so check every skip_add op names its mirror's output.
    assert sorted(skips) == [(i, layers - 1 - i) for i in range(layers // 2 - 1)]
    for i in range(layers):
        name = f"u.{i}.skip_add"
        if i < layers // 2:
            assert name not in g
        else:
            assert g[name].inputs[1] == f"u.{layers - 1 - i}.mlp.residual"


def test_tie_keys_shared_by_repeated_blocks():
    g = models.gpt(64, 3, 4, 16, 128, batch=2)
    by_block: dict[int, set[str]] = {}
    for op in g.ops:
        if op.block_index is not None:
            by_block.setdefault(op.block_index, set()).add(op.tie_key)
    assert len(by_block) == 3
    assert by_block[0] == by_block[1] == by_block[2]
    assert g["h.0.attn.qkv"].tie_key == g["h.2.attn.qkv"].tie_key == "h.*.attn.qkv"
    assert g["embed"].tie_key is None and g["lm_head"].tie_key is None
    # U-Transformer: the second half's blocks have one more op (the skip add).
    u = models.u_transformer(32, 4, 4, 8, 2)
    keys = {i: {op.tie_key for op in u.ops if op.block_index == i} for i in range(4)}
    assert keys[2] - keys[0] == {"u.*.skip_add"} and keys[0] == keys[1]


def _spec(**extra):
    ops = [
        {"name": "x", "kind": "input", "shape": [8, 16]},
        {"name": "fc1", "kind": "linear", "inputs": ["x"], "shape": [8, 32], "weight": [16, 32],
         "params": 16 * 32 + 32},
        {"name": "act", "kind": "gelu", "inputs": ["fc1"], "shape": [8, 32]},
        {"name": "fc2", "kind": "linear", "inputs": ["act"], "shape": [8, 16],
         "weight": [32, 16], "block": "b", "block_index": 0},
        {"name": "attn", "kind": "attention", "inputs": ["fc2"], "shape": [8, 16],
         "attrs": {"heads": 4, "seq_len": 4}},
        {"name": "loss", "kind": "loss", "inputs": ["attn"], "shape": [1]},
    ]
    return {"kind": "graph", "name": "toy", "ops": ops, **extra}


def test_an_elementwise_op_may_read_a_model_input_and_be_solved() -> None:
    """A ReLU reading the input has layouts of its own (it follows no producer): solved,
    not a traceback; the ops after it follow it as usual."""
    from ilp_planner.api import solve

    ops = [{"name": "x", "kind": "input", "shape": [8, 16]},
           {"name": "r", "kind": "relu", "inputs": ["x"], "shape": [8, 16]},
           {"name": "fc", "kind": "linear", "inputs": ["r"], "shape": [8, 4], "weight": [16, 4]},
           {"name": "loss", "kind": "loss", "inputs": ["fc"], "shape": [1]}]
    cluster = {"nodes": 1, "devices_per_node": 2, "memory_gib": 1, "peak_tflops": 1,
               "links": {"intra": {"latency_us": 1, "bandwidth_gbps": 10},
                         "inter": {"latency_us": 1, "bandwidth_gbps": 10}}}
    plan = solve({"kind": "graph", "name": "relu", "ops": ops}, cluster=cluster,
                 baselines=False)
    assert plan.solver.status == "optimal" and plan.layer("r").strategy != ""


def test_a_pool_reading_a_model_input_gets_a_config_error_not_a_traceback() -> None:
    """A pool (or flatten) is laid out as the op producing its input: reading the model's
    input straight away (an imported ``nn.Sequential(AvgPool2d, …)``), it says so."""
    import torch
    from torch import nn

    from ilp_planner.api import solve
    from ilp_planner.inputs.importer import from_module

    g = from_module(nn.Sequential(nn.AvgPool2d(2), nn.Flatten(), nn.Linear(12, 10)),
                    (torch.zeros(4, 3, 4, 4),))
    link = {"latency_us": 1, "bandwidth_gbps": 10}
    with pytest.raises(ConfigError, match=r"op '0' \(pool\) reads a model input directly"):
        solve(g, cluster={"nodes": 1, "devices_per_node": 2, "memory_gib": 1,
                          "peak_tflops": 1, "links": {"intra": link, "inter": link}},
              baselines=False)


def test_graph_from_spec_builds_and_defaults():
    g = models.graph_from_spec(_spec(), "toy.yaml")
    assert g.name == "toy" and len(g) == 6
    assert g.total_params == 16 * 32 + 32 + 32 * 16  # fc2 params default to the weight size
    assert g["fc1"].attr("bias") == 1 and g["fc2"].attr("bias") == 0
    assert g["fc1"].flops == 2.0 * 8 * 16 * 32  # 2·M·K·N
    assert g["attn"].attr("heads") == 4
    assert g["fc2"].tie_key == "b.*.fc2"
    assert g.edges()[0] == ("x", "fc1")


@pytest.mark.parametrize("mutate,key,text", [
    (lambda s: s["ops"][2].update(inputs=["fc9"]), "model.ops[2].inputs[0]", "not an op"),
    (lambda s: s["ops"][2].update(inputs=["fc2"]), "model.ops[2].inputs[0]", "defined later"),
    (lambda s: s["ops"][2].update(kind="swish"), "model.ops[2].kind", "unknown op kind"),
    (lambda s: s["ops"][2].update(name="fc1"), "model.ops[2].name", "duplicate"),
    (lambda s: s["ops"][1].update(shape=[8, 0]), "model.ops[1].shape[1]", "positive"),
    (lambda s: s["ops"][1].update(weight=[15, 32]), "model.ops[1].weight", "in-features"),
    (lambda s: s["ops"][4].update(attrs={"heads": 4}), "model.ops[4].attrs", "seq_len"),
    (lambda s: s["ops"][2].update(colour="red"), "model.ops[2].colour", "unknown key"),
    (lambda s: s["ops"][2].pop("shape"), "model.ops[2].shape", "missing required key"),
    (lambda s: s["ops"][3].pop("block"), "model.ops[3].block", "together"),
    (lambda s: s["ops"][2].update(inputs=[]), "model.ops[2].inputs", "at least one input"),
    (lambda s: s.update(ops=[]), "model.ops", "at least 1"),
    (lambda s: s["ops"][0].update(inputs=["x"]), "model.ops[0].inputs", "reads no other op"),
    (lambda s: s["ops"][2].update(shape=[8, 16]), "model.ops[2].inputs[0]",
     "input of shape [8, 32] neither broadcasts to its output's [8, 16]"),
    (lambda s: s["ops"][5].update(inputs=["x"]), "model.ops[5].inputs[0]",
     "a loss op follows the op producing its input, not a model input ('x')"),
])
def test_graph_from_spec_errors(mutate, key, text):
    spec = _spec()
    mutate(spec)
    with pytest.raises(ConfigError) as info:
        models.graph_from_spec(spec, "toy.yaml")
    msg = str(info.value)
    assert msg.startswith(f"toy.yaml: {key}: "), msg
    assert text in msg
    assert info.value.key == key and info.value.source == "toy.yaml"
