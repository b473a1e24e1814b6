"""The ``kind: moe`` builder's block variants and routers: Llama-style blocks (RMSNorm,
SwiGLU dense MLP, rotary positions, grouped-query attention, untied head) with the first k
blocks dense, dropless routing of the built-in op, and DeepSeek-V3's sigmoid router with its selection-only
correction bias and routed scaling factor — parameters in closed form, bad keys named, the
router against a token-by-token loop, and (slow, one launch of 4 gloo ranks) the variants
trained under expert-parallel, tensor-parallel, mixed and pipelined plans matching one
process with executed = planned."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from ilp_planner.errors import ConfigError
from ilp_planner.inputs import models
from ilp_planner.inputs.config import load_config, parse_config
from ilp_planner.ir.graph import OpKind
from ilp_planner.lowering.moe_strategies import DISPATCH, RECEIVED, moe_param_shapes
from ilp_planner.testing import pipelined_plan, restricted_plan, sharded_plan
from runtime import model, moe
from runtime.optim import OptimizerSpec
from runtime.reference import compare, run_reference
from tests.helpers.procs import run

ROOT = Path(__file__).resolve().parent.parent
TINY = dict(hidden=32, layers=3, heads=4, seq_len=8, vocab=64, batch=8, experts=4, top_k=2,
            expert_ffn=48)
STEPS = 3
RTOL = 1e-4


def llama_moe_params(h: int, layers: int, vocab: int, e: int, f: int, dense_ffn: int,
                     moe_layers: int, shared: int = 0, sigmoid: bool = False,
                     kv_share: float = 1.0) -> int:
    """Untied embedding and head 2V·h, final norm h; per block attention 2h² + 2h·(kv_share·h)
    (4h² without grouped queries) and two RMSNorm gains 2h; an MoE (router h·E, a sigmoid's E
    correction biases, E SwiGLU experts 3h·f, shared 3h·f_s) or a dense SwiGLU MLP 3h·f_d."""
    dense = layers - moe_layers
    attention = 2 * h * h + 2 * h * int(kv_share * h)
    return (2 * vocab * h + h + layers * (attention + 2 * h) + dense * 3 * h * dense_ffn
            + moe_layers * (h * e + (e if sigmoid else 0) + 3 * h * (e * f + shared)))


def test_llama_blocks_count_parameters_in_closed_form_with_the_first_k_dense():
    g = models.moe(**TINY, block="llama", first_dense=1, dense_ffn=40)
    assert g.total_params == llama_moe_params(32, 3, 64, 4, 48, 40, moe_layers=2) == 57_568
    assert [op.name for op in g.ops if op.kind is OpKind.MOE] == ["h.1.moe", "h.2.moe"]
    kinds = {op.kind for op in g.ops}
    assert {OpKind.RMSNORM, OpKind.SILU, OpKind.MUL} <= kinds
    assert OpKind.LAYERNORM not in kinds and OpKind.DROPOUT not in kinds
    assert "seq_len" not in g["embed"].attrs  # no position table: rotary in attention
    assert g["h.0.attn.core"].attrs["rope_theta"] == models.ROPE_THETA
    assert not g["lm_head"].attrs["tied"]
    every2 = models.moe(**{**TINY, "layers": 6}, block="llama", first_dense=2, moe_every=2,
                        shared_experts=1, shared_ffn=16, router="sigmoid", kv_heads=2)
    assert [op.name for op in every2.ops if op.kind is OpKind.MOE] == ["h.3.moe", "h.5.moe"]
    assert every2.total_params == llama_moe_params(32, 6, 64, 4, 48, 128, moe_layers=2,
                                                   shared=16, sigmoid=True, kv_share=0.5)
    assert every2["h.0.attn.core"].attrs["kv_heads"] == 2
    assert every2["h.0.attn.qkv"].output.shape == (64, 32 + 2 * 2 * 8)


def test_grouped_query_attention_is_attention_with_keys_and_values_repeated():
    """Group-major fused QKV with 2 key/value heads for 4 query heads computes what the
    head-major form computes with each key/value head written out for both its queries."""
    b, s, d, heads, kv = 2, 8, 4, 4, 2
    gqa = torch.randn(b * s, kv * (heads // kv + 2) * d, generator=torch.Generator().manual_seed(5))
    groups = gqa.view(b * s, kv, heads // kv + 2, d)
    per_head = [torch.stack([groups[:, g, j], groups[:, g, -2], groups[:, g, -1]], 1)
                for g in range(kv) for j in range(heads // kv)]  # (tokens, 3, d) each
    mha = torch.stack(per_head, 1).reshape(b * s, heads * 3 * d)
    torch.testing.assert_close(model.attention(gqa, heads, s, models.ROPE_THETA, kv),
                               model.attention(mha, heads, s, models.ROPE_THETA))


def test_the_deepseek_v2_lite_config_counts_in_closed_form():
    """Llama blocks, block 0 dense (10944), 26 MoE blocks of 64 + 2 shared experts."""
    m = load_config(ROOT / "configs" / "deepseek-v2-lite-2x8.yaml").model
    assert (m["block"], m["first_dense"]) == ("llama", 1)
    got = load_config(ROOT / "configs" / "deepseek-v2-lite-2x8.yaml").graph.total_params
    assert got == llama_moe_params(2048, 27, 102400, 64, 1408, 10944, moe_layers=26,
                                   shared=2 * 1408) == 15_787_866_112


def test_the_mixtral_config_counts_mixtrals_parameters():
    """Llama blocks with 8 of 32 key/value heads, 32 MoE blocks of 8 experts: 46,702,792,704,
    Mixtral-8x7B's count."""
    cfg = load_config(ROOT / "configs" / "mixtral-8x7b-8x8.yaml")
    assert cfg.graph.total_params == llama_moe_params(
        4096, 32, 32000, 8, 14336, 4 * 4096, moe_layers=32, kv_share=0.25) == 46_702_792_704


def test_gpt_blocks_keep_their_graph_and_take_first_dense():
    g = models.moe(**TINY)
    assert g.name == "moe-L3-h32-e4k2" and "seq_len" in g["embed"].attrs
    first = models.moe(**TINY, first_dense=2, dense_ffn=64)
    assert [op.name for op in first.ops if op.kind is OpKind.MOE] == ["h.2.moe"]
    # the dense blocks' 4h MLP (8h² + 5h) becomes 2h·f_d + f_d + h
    assert first.total_params - g.total_params == 2 * (
        2 * 32 * 64 + 64 + 32 - (32 * 4 + 3 * 32 * 4 * 48))


@pytest.mark.parametrize("key, value, words", [
    ("first_dense", 4, "model.first_dense: first_dense 4 exceeds the 3 layers"),
    ("first_dense", 3, "model.first_dense: no block has an MoE MLP"),
    ("block", "mamba", "model.block"),
    ("router", "hash", "model.router"),
    ("routed_scale", 0.0001, "model.routed_scale: expected a positive multiple of 0.001"),
    ("dense_ffn", 0, "model.dense_ffn"),
    ("kv_heads", 2, "model.kv_heads: grouped-query attention \\(kv_heads\\) needs block: llama"),
    ("dropless", "yes", "model.dropless"),
    ("expert_groups", 3, "model.expert_groups: 3 expert groups do not divide the 4 experts"),
    ("topk_groups", 2, "model.topk_groups: topk_groups 2 exceeds the 1 expert groups")])
def test_bad_block_and_router_keys_name_the_key(key, value, words):
    data = {"model": {"kind": "moe", **TINY, key: value},
            "cluster": {"nodes": 1, "devices_per_node": 4, "memory_gib": 1, "peak_tflops": 1,
                        "links": {"intra": {"latency_us": 1, "bandwidth_gbps": 1},
                                  "inter": {"latency_us": 1, "bandwidth_gbps": 1}}}}
    with pytest.raises(ConfigError, match=words) as exc:
        parse_config(data, "moe.yaml")
    assert "\n" not in str(exc.value)


def test_dropless_and_router_keys_become_the_ops_integer_attrs():
    g = models.moe(**TINY, dropless=True, router="sigmoid", routed_scale=2.5)
    attrs = next(op for op in g.ops if op.kind is OpKind.MOE).attrs
    assert (attrs["dropless"], attrs["sigmoid"], attrs["route_scale"]) == (1, 1, 2500)
    plain = next(op for op in models.moe(**TINY).ops if op.kind is OpKind.MOE).attrs
    assert not {"dropless", "sigmoid", "route_scale"} & set(plain)


@pytest.mark.parametrize("norm", [True, False])
def test_the_sigmoid_router_selects_by_biased_scores_and_weights_by_scores(norm):
    """DeepSeek-V3: top-k of sigmoid(logits) + bias selects; the selected unbiased scores,
    renormalised where asked, times the routed scaling factor weight; the bias's gradient
    is exactly zero."""
    g = models.moe(**{**TINY, "layers": 1}, router="sigmoid", routed_scale=2.5, norm_topk=norm)
    op = next(op for op in g.ops if op.kind is OpKind.MOE)
    p = {s.role: model.init_param(s, 0).requires_grad_(True) for s in model.param_specs(op)}
    assert set(p) == set(moe_param_shapes(op)) and p["score_bias"].shape == (4,)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    weights, chosen = moe.route(x, p["router"], op, p["score_bias"])
    scores = torch.sigmoid(x @ p["router"])
    for t in range(x.shape[0]):
        want = (scores[t] + p["score_bias"]).topk(2).indices
        assert chosen[t].tolist() == want.tolist()
        w = scores[t][want]
        torch.testing.assert_close(weights[t], 2.5 * (w / w.sum() if norm else w))
    plain = (scores.detach()).topk(2, dim=-1).indices
    assert (plain != chosen).any(), "the bias changes some selection"
    moe.reference(op, x, p).sum().backward()
    assert p["score_bias"].grad is not None and not p["score_bias"].grad.any()


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_group_limited_routing_takes_the_top_k_of_the_best_groups(router):
    """8 experts in 4 groups, 2 kept: a softmax router ranks a group by its best score
    (DeepSeek-V2's group_limited_greedy), a sigmoid router by the sum of its two best
    biased scores (V3); the top-3 come from the kept groups only."""
    g = models.moe(**{**TINY, "layers": 1, "experts": 8, "top_k": 3}, router=router,
                   expert_groups=4, topk_groups=2)
    op = next(op for op in g.ops if op.kind is OpKind.MOE)
    assert (op.attrs["groups"], op.attrs["topk_groups"]) == (4, 2)
    p = {s.role: model.init_param(s, 0) for s in model.param_specs(op)}
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(4))
    bias = p.get("score_bias")
    weights, chosen = moe.route(x, p["router"], op, bias)
    logits = x @ p["router"]
    scores = torch.sigmoid(logits) if router == "sigmoid" else torch.softmax(logits, -1)
    choice = scores + bias if bias is not None else scores
    limited = 0
    for t in range(x.shape[0]):
        per = choice[t].view(4, 2)
        rank = per.sum(-1) if router == "sigmoid" else per.amax(-1)
        kept = rank.topk(2).indices
        allowed = torch.cat([torch.arange(2 * i, 2 * i + 2) for i in kept.tolist()])
        want = allowed[choice[t][allowed].topk(3).indices]
        assert sorted(chosen[t].tolist()) == sorted(want.tolist())
        w = scores[t][chosen[t]]
        torch.testing.assert_close(weights[t], w / w.sum())
        limited += set(want.tolist()) != set(choice[t].topk(3).indices.tolist())
    assert limited, "some token's unrestricted top-3 crosses a dropped group"


# -- trained on 4 gloo processes ---------------------------------------------------------------


def _label_is(rules: dict[str, str]):
    """A filter keeping, for each op whose name ends with a key of ``rules``, the strategy
    with that label."""
    def keep(op, s) -> bool:
        want = next((lab for end, lab in rules.items() if op.name.endswith(end)), None)
        return want is None or s.label == want
    return keep


LLAMA = {"cluster.nodes": 1, "cluster.devices_per_node": 4, "model.block": "llama",
         "model.layers": 2, "model.first_dense": 1, "model.dense_ffn": 40, "model.kv_heads": 2}
TP = {"mlp.gate": "3d(p0=2,p1=2,p2=1)", "mlp.up": "3d(p0=2,p1=2,p2=1)",
      "mlp.down": "3d(p0=2,p1=1,p2=2)", "attn.qkv": "3d(p0=2,p1=2,p2=1)",
      "attn.proj": "3d(p0=2,p1=1,p2=2)"}


# The dropless sigmoid variants train with SGD: under Adam their attention weights' elements
# whose gradient is rounding noise step ±lr (tests/test_moe_runtime.py's note) and land at
# 1.1e-4 from one process on 4 ranks after 3 steps, the losses within 2e-6
OPTIMIZERS = {"llama-ep": ("adam", 0.01), "llama-tp": ("adam", 0.01),
              "v3-dropless-ep": ("sgd", 0.1), "v3-dropless-mixed": ("sgd", 0.1),
              "v3-pipeline": ("sgd", 0.1), "v3-zero3": ("sgd", 0.1)}
MICROBATCHES = {"v3-pipeline": 2}


def _plans():
    c = load_config(ROOT / "configs" / "tiny-moe-cpu.yaml").with_overrides(LLAMA)
    v3 = c.with_overrides({"model.dropless": True, "model.router": "sigmoid",
                           "model.routed_scale": 2.5, "model.shared_experts": 1,
                           "model.expert_groups": 2, "model.topk_groups": 1,
                           "model.shared_ffn": 16})
    return {"llama-ep": restricted_plan(c, _label_is({"moe": "moe(dp=1,ep=4,etp=1)"}),
                                        name="llama-ep"),
            "llama-tp": restricted_plan(c, _label_is({**TP, "moe": "moe(dp=2,ep=2,etp=1)"}),
                                        name="llama-tp"),
            "v3-dropless-ep": restricted_plan(v3, _label_is({"moe": "moe(dp=1,ep=4,etp=1)"}),
                                              name="v3-dropless-ep"),
            "v3-dropless-mixed": restricted_plan(v3, _label_is({"moe": "moe(dp=1,ep=2,etp=2)"}),
                                                 name="v3-dropless-mixed"),
            # the dense block 0 on one stage of 2 devices, the MoE block 1 on the other
            "v3-pipeline": pipelined_plan(v3, stages=2, microbatches=MICROBATCHES["v3-pipeline"],
                                          cut_after=["h.0.mlp.residual"],
                                          keep=_label_is({"moe": "moe(dp=1,ep=2,etp=1)"}),
                                          name="v3-pipeline"),
            # ZeRO-3 on every op that syncs gradients; the correction bias (no gradient to
            # reduce) stays whole on every rank
            "v3-zero3": sharded_plan(v3, 3, keep=_label_is({"moe": "moe(dp=2,ep=2,etp=1)+zero3"}),
                                     name="v3-zero3")}


@pytest.fixture(scope="module")
def block_runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("moe-blocks")
    plans = _plans()
    files = []
    for name, plan in plans.items():
        plan.save(tmp / f"{name}.json")
        files.append(str(tmp / f"{name}.json"))
    cmd = [sys.executable, "-m", "ilp_planner.cli", "run", *files, "--nproc-per-node", "4",
           "--steps", str(STEPS), "--quiet",
           "--optimizer", ",".join(OPTIMIZERS[n][0] for n in plans),
           "--lr", ",".join(str(OPTIMIZERS[n][1]) for n in plans),
           "--results", str(tmp / "results.json"), "--save-params", str(tmp / "params"),
           "--audit", "--check-reference"]
    res = run(cmd, timeout=420)
    assert res.returncode == 0, f"launch failed:\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    out = {Path(r["file"]).stem: r for r in json.loads((tmp / "results.json").read_text())}
    for stem, r in out.items():
        r["params"] = torch.load(tmp / "params" / f"{stem}.pt")
        r["plan"] = plans[stem]
    return {"results": out, "stdout": res.stdout}


@pytest.mark.slow
def test_llama_and_dropless_sigmoid_moe_train_on_4_ranks_as_one_process(block_runs):
    assert "MISMATCH" not in block_runs["stdout"]
    assert set(block_runs["results"]) == set(OPTIMIZERS)
    for name, r in block_runs["results"].items():
        graph = parse_config(r["plan"].config).graph
        ref = run_reference(graph, steps=STEPS, seed=0, optimizer=OptimizerSpec(*OPTIMIZERS[name]),
                            microbatches=MICROBATCHES.get(name, 1))
        assert r["audit_ok"] is True, name
        layers = {ly.name: ly for ly in r["plan"].layers}
        purposes = {c.purpose for c in layers["h.1.moe"].collectives}
        assert DISPATCH in purposes, name
        assert (RECEIVED in purposes) == name.startswith("v3"), name
        for got, want in zip(r["losses"], ref.losses, strict=True):
            assert abs(got - want) <= RTOL * abs(want), name
        cmp = compare(r["losses"], r["params"], ref)
        assert cmp.ok(RTOL), f"{name}: {cmp.worst_param} rel err {cmp.param_rel_err:.2e}"
        if name.startswith("v3"):  # the correction bias only selects: never stepped
            bias = "h.1.moe.score_bias"
            assert torch.equal(r["params"][bias], model.init_params(graph, 0)[bias]), name
