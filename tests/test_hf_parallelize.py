"""Hugging Face models under ``parallelize`` (:mod:`runtime.apply`), the models users bring.

Multi-process (slow): torchrun launches per cluster shape (:data:`LAUNCHES` of them, each a
share of the models, so none nears the per-test timeout on a slow machine) run every model
of :data:`tests.helpers.hf_apply_check.MODELS` — imported with ``ilp_planner.from_module``,
solved for 4 devices, applied, trained 3 steps on the model's own ``ModelOutput``, its
gradients clipped (``ilp_planner.clip_grad_norm_`` against torch's on one process) and the
second step accumulating two backwards — and each
test reads its model's line: the losses match one process (fp32, 1e-4), the collectives
executed are the planned ones, every step, on every rank, and after training the module's
whole state (``runtime.apply.full_state_dict``: Phi-3's fused ``gate_up_proj`` in its own
column order, a channel-split batch norm's running statistics from every rank) is one
process's, the same on every rank, and ``load_full_state_dict`` sets what it is given.
The 1 × 4 launch also trains Llama's and GPT-2's Megatron plans through ``to_parallelize_plan`` and PyTorch's
``parallelize_module`` (2-way data × 2-way tensor parallel), matching one process. Megatron
and Megatron-SP plans (the baselines' layouts) train under ``parallelize`` on both shapes,
attention split over the batch and the heads at once. The 2 × 2 cluster gives plans on a
mesh whose first axis walks a node's devices (ranks ``0,2,1,3`` in DeviceMesh order), which
``parallelize`` runs as an explicit rank grid. Mixtral and Qwen2-MoE train with expert-
parallel plans (:mod:`runtime.applied_moe`), and Mixtral with DeepSeek-V3's routers. ResNet
trains with its batch norms synchronised over the devices splitting its batch. Phi-3 trains
with its fused ``gate_up_proj`` split over its columns (matching gate and up blocks on each
device).
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

import pytest

from tests.helpers.procs import run

SHAPES = ("1x4", "2x2")
CONFIGS = Path(__file__).resolve().parent.parent / "configs"


LAUNCHES = 4
"""Launches per shape: the harness's cases in this many consecutive shares (the 1 × 4
shape's last share with the tensor-parallel styles' checks)."""


def _cases() -> list[str]:
    from tests.helpers.hf_apply_check import MODELS, REFUSED

    return [*MODELS, *REFUSED]


def _share(model: str) -> int:
    """Which launch of a shape runs ``model`` (a ``tp-styles-*`` check: the last)."""
    if model.startswith("tp-styles-"):
        return LAUNCHES - 1
    cases = _cases()
    return cases.index(model) * LAUNCHES // len(cases)


@functools.cache
def launch(shape: str, share: int) -> str:
    """The output of one 4-rank launch running share ``share`` of the models on ``shape``."""
    cases = [c for c in _cases() if _share(c) == share]
    styles = ["--tp-styles"] if shape == "1x4" and share == LAUNCHES - 1 else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "4", "tests/helpers/hf_apply_check.py", "--shape", shape, *styles, *cases]
    res = run(cmd, 900)
    return res.stdout + res.stderr


def line_of(shape: str, model: str) -> str:
    out = launch(shape, _share(model))
    ok = [ln for ln in out.splitlines() if ln.startswith(f"OK {model} ")]
    assert ok, f"{model} on {shape}:\n" + "\n".join(
        ln for ln in out.splitlines() if f" {model} " in ln or ln.startswith("FAIL"))[-4000:]
    return ok[0]


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("share", range(LAUNCHES))
def test_every_case_of_the_harness_passes(shape, share):
    """Every case of a launch — the models and refusals the tests below name, and the
    others (GPT-OSS, HunYuan-MoE, MiniMax-M2, Qwen3.5, GLM-4-MoE-Lite, …) — prints its OK
    line: a case no test names still fails the suite (before, twenty ran unchecked)."""
    out = launch(shape, share)
    lines = out.splitlines()
    failed = [c for c in _cases() if _share(c) == share
              and not any(ln.startswith(f"OK {c} ") for ln in lines)]
    assert not failed, f"{failed} on {shape}:\n" + "\n".join(
        ln for ln in lines if ln.startswith("FAIL"))[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("model", ["llama", "llama-tied", "llama-tied-exchanging"])
def test_llama_trains_like_one_process_and_the_plan(model, shape):
    """``llama-tied-exchanging``: the table whole, the head split 4 ways on the vocabulary,
    so the tied exchange moves data (an AllGather the audit counts)."""
    line = line_of(shape, model)
    assert "3d(" in line  # the plan splits weights, not only the batch
    if shape == "2x2" and model != "llama-tied-exchanging":
        assert "0,2,1,3" in line  # a mesh that is not a row-major view of the ranks


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("model", ["qwen3", "gemma3"])
def test_per_head_qk_norms_train_split_by_heads_like_one_process(model, shape):
    """Qwen3's and Gemma-3's q / k norms, imported as norms on their projections' values
    normalising each head apart, with their heads split 2 ways in both layers (Gemma-3's
    module reads ``(b, heads, s, d)``): the modules run on this rank's heads, the gains'
    gradients summed over the heads axis by the plan's AllReduce — losses match one process
    and the audit matches every collective."""
    line = line_of(shape, model)
    assert "heads-split-norms=4" in line and "dp×tp-attention=2" in line, line


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("model", ["llama-megatron", "llama-megatron-sp", "bert-megatron-sp"])
def test_megatron_plans_train_with_attention_split_over_batch_and_heads(model, shape):
    """Megatron (and Megatron-SP) on the imported models: the user's attention runs on
    DTensors split over the batch on the data-parallel axis and over the heads on the
    tensor-parallel one, in both of the model's attention layers. Llama's Megatron-SP plan
    has its gated MLP's product on the tensor-parallel columns (what
    ``tests/test_megatron_sp_region.py`` checks layer by layer); here, that it runs."""
    assert "dp×tp-attention=2" in line_of(shape, model)


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("model", ["titan-llama", "titan-llama-megatron-sp"])
def test_a_hand_written_torchtitan_style_llama_trains_like_one_process(model, shape):
    """Not every model users bring is Hugging Face's: a Llama written the way torchtitan's
    is — rotary positions as complex products (``view_as_complex``), grouped-query heads by
    ``repeat_interleave``, blocks in a ``ModuleDict`` — under the solver's plan and under
    Megatron-SP's layouts."""
    line = line_of(shape, model)
    assert "3d(" in line
    if model.endswith("megatron-sp"):
        assert "dp×tp-attention=2" in line


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("model", ["mixtral", "qwen2-moe"])
def test_hf_moe_trains_expert_parallel_like_one_process_and_the_plan(model, shape):
    """Mixtral and Qwen2-MoE with every routed block expert parallel (the plan's best among
    those): the runtime's kernel runs in each experts module on this rank's tokens and
    experts, dropless as Hugging Face routes — the token counts exchanged first, then
    exactly the routed rows — every AllToAll matched by the audit (the received rows
    within their bound)."""
    line = line_of(shape, model)
    assert re.search(r"moe\(dp=\S+,ep=\S+,etp=1\)", line), line
    exchanged = re.search(r"all_to_all=(\S+)", line)
    assert exchanged, line
    assert {"moe_counts", "moe_dispatch", "moe_received", "moe_combine"} <= set(
        exchanged.group(1).split(",")), line


@pytest.mark.slow
@pytest.mark.parametrize("model,shape", [("deepseek-v2", "1x4"), ("deepseek-v2", "2x2"),
                                         ("deepseek-v3", "1x4"), ("deepseek-v3", "2x2")])
def test_deepseek_with_multi_head_latent_attention_trains_like_one_process(model, shape):
    """DeepSeek-V2 and V3 (MLA — V3's with a low-rank query —, layer 0 dense, layer 1
    routed): MLA's functional code — V2's rotary in complex numbers, the key states written
    into a ``new_empty`` tensor, the latent columns' copy — runs on DTensors in the plan's
    layouts, the MoE block on the runtime's kernel; losses match one process and every
    collective is the plan's — ``kv_a_proj_with_mqa``'s output, read by the latent copy and
    the attention (a shared read: :mod:`ilp_planner.lowering.shared_reads`), converted and
    priced once."""
    line = line_of(shape, model)
    assert re.search(r"moe\(dp=\S+", line), line


@pytest.mark.slow
def test_a_plan_parallelize_cannot_run_is_refused_before_anything_changes():
    """DeepSeek-V2 planned with MLA's heads split and ``kv_a_proj_with_mqa`` split over the
    batch reads that projection's output in two layouts in functional code: ``parallelize``
    refuses naming it before it swaps the MoE block's forwards, installs a hook or places
    a parameter (the module is checked untouched on every rank)."""
    assert "feeds functional code in two layouts" in line_of("1x4", "deepseek-v2-refused")


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_deepseek_v3_routing_trains_expert_parallel_like_one_process(shape):
    """DeepSeek-V3's router (sigmoid scores, a correction-bias buffer that only selects, the
    best of two expert groups, weights renormalised and scaled by 2.5) in Mixtral blocks
    (V3's own model is not in the launch; its MLA is V2's, with a low-rank query): the kernel reads
    the router's buffer on each rank and routes as the block does, dropless expert parallel,
    every AllToAll audited."""
    line = line_of(shape, "mixtral-v3-router")
    assert re.search(r"moe\(dp=\S+,ep=\S+,etp=1\)", line), line
    assert "moe_counts" in line and "moe_received" in line, line


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_whisper_with_its_frozen_position_table_trains_like_one_process(shape):
    """Whisper's encoder position table ships frozen: planned held alone (no gradient,
    synchronisation or optimizer state), kept frozen and unchanged by ``parallelize``,
    the rest trained like one process, every collective the plan's (it was refused)."""
    line_of(shape, "whisper")


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("model", ["llama-lora", "gpt2-frozen-lower", "bert-frozen-encoder"])
def test_fine_tunings_train_like_one_process(model, shape):
    """Fine-tunings as users run them: LoRA adapters on a frozen Llama, GPT-2 with its
    first block frozen (a repeated block's frozen copy planned apart from its trained
    ones), BERT with its encoder frozen under a trained head — the same losses and saved
    state as one process, every collective the plan's (the gradient AllReduces the plan
    lists are the ones the trained layers issue)."""
    line_of(shape, model)


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("model", ["llama-bf16", "gpt2-bf16"])
def test_bfloat16_modules_train_as_they_are_every_collective_the_plans(model, shape):
    """A module loaded in bfloat16 trains its parameters as they are: gradients reduced
    (and GPT-2's tied head exchanged) in bfloat16, as the plan prices them — the audit
    matched every step (the plan priced them in float32, twice the bytes run) — and the
    losses and state one process's within bfloat16's rounding."""
    line_of(shape, model)


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_gpt2s_megatron_plan_trains_with_its_heads_whole_over_tp(shape):
    """GPT-2's attention reads ``c_attn``'s ``[q | k | v]`` column blocks, which are not whole
    heads: its Megatron plan keeps them whole over TP (column- and row-parallel Conv1Ds, the
    attention's input gathered), and trains like one process."""
    line = line_of(shape, "gpt2-megatron")
    assert "3d(p0=2,p1=2,p2=1)" in line and "3d(p0=2,p1=1,p2=2)" in line
    assert "dp×tp-attention=0" in line


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("model", ["phi3", "phi3-gate-up-split"])
def test_phi3s_fused_gate_up_trains_split_over_its_columns_like_one_process(model, shape):
    """Phi-3's fused ``gate_up_proj`` (its output ``chunk``ed into gate and up): the solver's
    plan, and one splitting its columns over all 4 devices — each holding matching gate and
    up columns (the weight stored interleaved, the chunk run on each rank's block) and the
    product split as ``down_proj``'s rows read it — train like one process, every collective
    the plan's."""
    line = line_of(shape, model)
    if model == "phi3-gate-up-split":
        assert re.search(r"3d\(p0=1,p1=(4|2x2),p2=1\)", line), line


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("model", ["t5", "t5-tied-exchanging"])
def test_t5_trains_like_one_process_and_the_plan(model, shape):
    """T5: keyword inputs, one table looked up by the encoder and the decoder and tied to
    the head (``t5-tied-exchanging``: the decoder's copy split 4 ways on the vocabulary, the
    encoder's whole, so the exchange between the two embeddings moves data), and each
    stack's relative position bias in SDPA's mask, its table's gradient summed over the
    ranks' (batch × heads) blocks by the plan's AllReduce."""
    line_of(shape, model)


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_hf_moe_with_its_experts_sliced_trains_like_one_process(shape):
    """Expert slicing: tokens replicated over the experts' axis, each rank computing its
    own experts' routed copies only (no AllToAll), the output a partial sum."""
    line = line_of(shape, "mixtral-sliced")
    assert re.search(r"moe\(dp=\S+,xp=\S+,etp=1\)", line), line
    assert "moe_" not in line, line


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_megatron_plans_train_through_parallelize_module(model):
    """``gpt2``: its ``Conv1D`` layers take the ``(in, out)`` styles and its head stays one
    parameter with the word table (the run checks the parameter count and the losses)."""
    assert "styles" in line_of("1x4", f"tp-styles-{model}")


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("model", ["bert", "gpt2", "vit", "resnet"])
def test_hf_model_trains_like_one_process_and_the_plan(model, shape):
    """``gpt2``: Hugging Face's ``Conv1D`` projections shape their output from their whole
    sizes, so they run on DTensors, not on blocks. ``vit``: one opaque ``cat`` owns the class
    token and the position table; one ``nn.Dropout`` is called twice per layer (its hooks run
    its two ops in call order). ``resnet``: ``out += identity`` in place on a tensor a
    module's hook converted for that functional code."""
    line_of(shape, model)


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("model", ["roberta", "olmo", "convnext", "gemma2", "opt", "falcon",
                                   "bart", "granite-embedding-converted",
                                   "gemma-embedding-converted",
                                   "gpt2-gelu-after-conversion"])
def test_models_outside_the_first_set_train_like_one_process(model, shape):
    """``roberta``: its one ``input_ids`` tensor is read by the word table and by the
    functional code counting positions (the plan reads it in one layout, the runtime hands
    it over once). ``olmo``: layer norms with no parameters (the plan gives them none to
    synchronise). ``convnext``: images permuted to channels-last and back in every block
    (copies that keep whole images on a device), a layer scale owned by an op of its
    own. ``gemma2``: its logits soft-capped in functional code after the head, which reads
    them in the loss's layout (converted at the head's own boundary, not the root's).
    ``opt``: its positions' module adds their lookup to the word embeddings in its code,
    so the plan hands that sum on as the embedding produced it. ``bart``: one tensor of ids
    handed to its encoder and its decoder — two inputs of the plan, each read by its own
    table (export had made them one). ``falcon``: linears computing
    ``x @ W.T``, multi-query attention picking its key and value heads from the fused
    ``query_key_value`` by list indexing (run on each rank's rows, the batch split).
    ``granite-embedding-converted``: its model's code scales the embeddings before the
    first norm reads them (a read through functional code: converted at the embedding's
    boundary with the residual's, the norm checks what arrives), under a plan splitting the
    table's columns, so the embedding's boundary must convert (the solver's plan is the
    same today); ``gemma-embedding-converted``: the same plan where the scale runs inside
    the embedding's module, before its boundary. ``gpt2-gelu-after-conversion``: GPT-2's
    GELU module between a column-split ``c_fc`` and a column-parallel ``c_proj`` — code
    outside both modules on a value no functional code reads, so ``c_proj``'s own boundary
    converts it (its backward resolves the partial gradient before the GELU's backward)."""
    line_of(shape, model)


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("model", ["granitemoe", "no-grad-scaled", "convnext-wide",
                                   "convnextv2", "marian", "pegasus", "pvt", "mobilevit",
                                   "convbert", "roformer", "focalnet", "deberta",
                                   "clip-vision", "siglip", "dropout-on-constants",
                                   "fnet"])
def test_models_a_user_brings_from_the_zoo_train_like_one_process(model, shape):
    """``granitemoe``: its router held as ``router``, not ``gate`` (before, its blocks were
    exported as the expert loop's opaque ops and refused at the first forward).
    ``no-grad-scaled``: a ``torch.no_grad()`` block in the forward (before: the import
    crashed in torch's flop counter). ``convnext-wide``: a plan splitting the tokens of
    ConvNeXt's channels-first layer norm over both axes (before: the norm ran on local
    blocks assumed features-last, and the residual add failed to broadcast).
    ``convnextv2``: its GRN's per-image statistic on flattened tokens, an opaque op (before:
    the solve stopped at the graph's shape check). ``marian``, ``pegasus``: a frozen
    sinusoidal position table added to the trained word embeddings, an op of its own
    (before: folded into the embedding, refused as an op training some parameters only).
    ``pvt``, ``mobilevit``: convolutions reading tokens laid back out as images (before: the
    relayout was recorded tokens-major, and the solve stopped with a LayoutError).
    ``convbert``: the copy of the tokens its depthwise ``nn.Conv1d`` reads, named in that
    module's path (before: taken for a second call of the module and refused).
    ``roformer``: one frozen sinusoidal table read by every layer's functional rotary code,
    left a plain tensor each reader replicates on its own mesh (before: placed on layer 0's
    rotary op's mesh, it met layer 1's queries on another and the forward crashed).
    ``focalnet``: its head's adaptive pooling restrides a replicated value (before: DTensor
    refused the backward's ``as_strided``, mid-step). ``deberta``: a layer norm module whose
    bias another op owns runs on DTensors, not on local blocks (before: its local block met
    the bias's DTensor, and the next edge program ran on a DTensor inside a DTensor).
    ``clip-vision``: a norm no loss reads, whose parameters take no gradient (before: the
    step waited for their gradients, and reduced the others before they came).
    ``siglip``: an unused attention-pooling head reading the tokens the classifier's mean
    reads, in functional code (before: no choice could run, its ``F.linear`` having no
    replicated layout). ``dropout-on-constants``: a dropout module called on a constant
    between its planned calls, a call no op is (before: taken for the next planned call, and
    its plain tensor refused). ``fnet``: a module returning its op's value as a one-tensor
    tuple (before: refused as "got tuple")."""
    line_of(shape, model)


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("model", ["resnet-data-parallel", "resnet-batch-and-channels"])
def test_resnet_trains_with_synchronised_batch_norm(model, shape):
    """Batch norms splitting the batch (data parallel on all 4 devices; or the batch and the
    channels over two axes): each rank's block runs with the whole batch's statistics
    (:mod:`runtime.local_batchnorm`), its forward and backward AllReduces matched by the
    audit, and each rank's channels of every running mean and variance equal one
    process's."""
    line = line_of(shape, model)
    assert "batchnorm=backward,forward" in line, line
    if model == "resnet-batch-and-channels":
        assert "S(0)S(1)" in line, line


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("model", ["gpt2-dropout", "bert-eager-dropout"])
def test_models_with_their_default_dropouts_train_like_one_process(model, shape):
    """GPT-2 and BERT with their default dropouts (0.1): ``nn.Dropout`` on split and
    partial values, SDPA's ``dropout_p`` (GPT-2) and ``F.dropout`` on hand-written
    attention's probabilities (BERT) split over the batch and the heads. Every rank draws
    each mask whole from the same generator and keeps its block
    (:mod:`runtime.local_dropout`), so the losses and gradient norms are one process's
    drawing from the same state. Before, each rank drew its block's mask on its own: both
    differed at the first step."""
    line_of(shape, model)


@pytest.fixture
def one_rank():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("how", ["hugging-face", "checkpoint-wrapper"])
def test_a_module_that_checkpoints_its_activations_is_refused_before_anything_changes(
        one_rank, how):
    """Gradient checkpointing (Hugging Face's ``gradient_checkpointing_enable()``, torch's
    ``checkpoint_wrapper``) runs a block's forward again in the backward — its conversions
    and collectives unplanned: refused by ``parallelize`` naming the module, before a
    parameter is placed (it failed in the first backward)."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )
    from torch.distributed.tensor import DTensor

    import ilp_planner
    from runtime.apply import parallelize
    from runtime.errors import RuntimeSetupError
    from tests.helpers.hf_apply_check import MODELS, cluster

    torch.manual_seed(0)
    case = MODELS["llama"]()
    plan = ilp_planner.solve(ilp_planner.from_module(case.model, (case.inputs,)),
                             cluster=cluster(1, 1), baselines=False)
    if how == "hugging-face":
        case.model.gradient_checkpointing_enable()
        where = "model.layers.0"
    else:
        case.model.model.layers[1] = checkpoint_wrapper(case.model.model.layers[1])
        where = "model.layers.1"
    with pytest.raises(RuntimeSetupError, match=rf"module '{re.escape(where)}'.* checkpoints "
                                                r"its activations \(gradient checkpointing\)"):
        parallelize(plan, case.model)
    assert not any(isinstance(p, DTensor) for p in case.model.parameters())


def test_a_tied_llama_keeps_one_parameter_and_returns_its_model_output(one_rank):
    import copy

    import torch
    import torch.nn.functional as F

    import ilp_planner
    from runtime.apply import parallelize
    from tests.helpers.hf_apply_check import MODELS, cluster

    torch.manual_seed(0)
    case = MODELS["llama-tied"]()
    ref = copy.deepcopy(case.model)
    plan = ilp_planner.solve(ilp_planner.from_module(case.model, (case.inputs,)),
                             cluster=cluster(1, 1), baselines=False)
    model = parallelize(plan, case.model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert len(list(model.parameters())) == len(list(ref.parameters()))
    out = model(case.inputs)
    assert type(out).__name__ == "CausalLMOutputWithPast" and type(out.logits) is torch.Tensor
    F.cross_entropy(out.logits.flatten(0, 1), case.targets.flatten()).backward()
    F.cross_entropy(ref(case.inputs).logits.flatten(0, 1), case.targets.flatten()).backward()
    table = model.lm_head.weight.grad.full_tensor()  # both uses' gradients, in one
    assert torch.allclose(table, ref.lm_head.weight.grad, atol=1e-6)


def test_batch_norm_on_local_blocks_computes_what_one_process_does(one_rank):
    """:mod:`runtime.local_batchnorm`'s arithmetic on one rank (whole blocks, no group):
    three training steps of ResNet give the module's losses, and the running means and
    (unbiased) variances equal one process's; in eval mode, the same outputs."""
    import copy

    import torch

    import ilp_planner
    from runtime.apply import full_value, parallelize
    from tests.helpers.hf_apply_check import MODELS, cluster, loss_of

    torch.manual_seed(0)
    case = MODELS["resnet"]()
    ref = copy.deepcopy(case.model)
    plan = ilp_planner.solve(ilp_planner.from_module(case.model, (case.inputs,)),
                             cluster=cluster(1, 1), baselines=False)
    model = parallelize(plan, case.model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref)]
    for _ in range(3):
        losses = []
        for m, opt in zip((model, ref), opts, strict=True):
            loss = loss_of(m(case.inputs), case.targets)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(full_value(loss)))
        assert abs(losses[0] - losses[1]) <= 1e-5 * max(1.0, abs(losses[1]))
    norms = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert norms
    for name, bn in norms:
        twin = ref.get_submodule(name)
        assert torch.allclose(bn.running_mean, twin.running_mean, atol=1e-6)
        assert torch.allclose(bn.running_var, twin.running_var, atol=1e-5)
    model.eval()
    ref.eval()
    with torch.no_grad():
        mine = full_value(model(case.inputs).logits)
        assert torch.allclose(mine, ref(case.inputs).logits, atol=1e-5)


def test_batch_norm_keeps_the_variance_of_channels_whose_mean_dwarfs_their_spread(one_rank):
    """Channels around 1000 that vary by about 0.5: ``E[x²] − E[x]²`` in float32 misses
    their variance by tens of percent (E[x²] = 10⁶ carries 0.06 of rounding; the variance
    is about 0.2). The runtime's statistics come from each block's mean and variance,
    reduced in float64, so the normalised output is one process's to float32's
    resolution at 1000."""
    import copy

    import torch
    from torch import nn

    import ilp_planner
    from runtime.apply import full_value, parallelize
    from tests.helpers.hf_apply_check import cluster

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(64, 5))
    with torch.no_grad():
        model[0].bias.fill_(1000.0)
    ref = copy.deepcopy(model)
    x = torch.randn(8, 3, 4, 4)
    plan = ilp_planner.solve(ilp_planner.from_module(model, (x,)), cluster=cluster(1, 1),
                             baselines=False)
    applied = parallelize(plan, model)
    got, want = full_value(applied(x)), ref(x)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(applied[1].running_var, ref[1].running_var, rtol=1e-3,
                               atol=1e-6)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_t5_on_one_rank_keeps_its_shared_tables_one_parameter_each(one_rank, attention):
    """T5's one table (encoder and decoder lookups, the tied head) and each stack's relative
    position table (owned by its first self-attention, read as SDPA's mask by all of them,
    or added to hand-written scores) stay the module's parameters, and their gradients —
    every use's, summed — are the single-process module's."""
    import copy

    import torch

    import ilp_planner
    from runtime.apply import parallelize
    from tests.helpers.hf_apply_check import cluster, example, forward, loss_of, t5

    torch.manual_seed(0)
    case = t5(attention)
    ref = copy.deepcopy(case.model)
    plan = ilp_planner.solve(ilp_planner.from_module(case.model, example(case.inputs)),
                             cluster=cluster(1, 1), baselines=False)
    model = parallelize(plan, case.model)
    assert model.decoder.embed_tokens.weight is model.encoder.embed_tokens.weight \
        is model.lm_head.weight
    assert len(list(model.parameters())) == len(list(ref.parameters()))
    loss_of(forward(model, case.inputs), case.targets).backward()
    loss_of(forward(ref, case.inputs), case.targets).backward()
    bias = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    for name in ("shared.weight", f"encoder.{bias}", f"decoder.{bias}"):
        got = model.get_parameter(name).grad.full_tensor()
        torch.testing.assert_close(got, ref.get_parameter(name).grad, rtol=1e-5, atol=1e-6)


def test_t5_s_hand_written_attention_owns_its_position_table_as_sdpa_s_does():
    """Added to hand-written attention scores (not folded into a constant), each stack's
    relative position table is its first self-attention's, and every self-attention of the
    stack is marked as reading it — as where SDPA's mask adds it."""
    import torch

    import ilp_planner
    from tests.helpers.hf_apply_check import example, t5

    torch.manual_seed(0)
    graphs = {a: ilp_planner.from_module(t5(a).model, example(t5(a).inputs))
              for a in ("sdpa", "eager")}
    marks = {a: {(op.name.split(".")[0], op.attrs.get("bias_buckets"), op.source_params)
                 for op in g.ops if op.attrs.get("bias_table")} for a, g in graphs.items()}
    assert marks["eager"] == marks["sdpa"]
    owners = sorted(o for o in marks["eager"] if o[1])
    assert [o[0] for o in owners] == ["decoder", "encoder"]
    assert all(len(o[2]) == 1 and o[2][0].endswith("relative_attention_bias.weight")
               for o in owners)


def test_a_table_looked_up_at_constant_ids_outside_attention_is_refused_naming_it(one_rank):
    """XLM looks its position table up at ``arange`` ids and adds it to the embeddings
    through code the importer folds into a constant: no op owns the table, and
    ``parallelize`` refuses it before placing anything (its lookups would train it
    differently on every rank)."""
    import torch
    from transformers import XLMConfig, XLMWithLMHeadModel

    import ilp_planner
    from runtime.apply import parallelize
    from runtime.errors import RuntimeSetupError
    from tests.helpers.hf_apply_check import cluster

    torch.manual_seed(0)
    model = XLMWithLMHeadModel(XLMConfig(vocab_size=64, emb_dim=32, n_layers=2, n_heads=4,
                                         max_position_embeddings=16, dropout=0.0,
                                         attention_dropout=0.0))
    plan = ilp_planner.solve(ilp_planner.from_module(model, (torch.randint(0, 64, (4, 8)),)),
                             cluster=cluster(1, 1), baselines=False)
    with pytest.raises(RuntimeSetupError, match=r"embedding tables transformer\."
                                                r"position_embeddings\.weight are owned by "
                                                r"no op of the plan"):
        parallelize(plan, model)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())


def test_a_bare_bias_table_read_by_hand_written_attention_stops_at_its_first_gradient(
        one_rank):
    """LeViT indexes a bare ``attention_biases`` parameter at constant positions and adds
    it to its hand-written attention scores: the importer folds it into a constant, so no
    op owns it. Before, the scores' producer (a batch norm) took it and ``parallelize``
    refused a plan pricing two of its three parameters; now nothing owns it, and its first
    gradient stops the backward naming it — trained unowned, each rank's copy would drift.
    Frozen, it trains like one process's."""
    import torch
    import torch.nn.functional as F
    from transformers import LevitConfig, LevitForImageClassification

    import ilp_planner
    from runtime.apply import parallelize
    from runtime.errors import RuntimeSetupError
    from tests.helpers.hf_apply_check import cluster

    def levit(frozen: bool):
        torch.manual_seed(0)
        model = LevitForImageClassification(LevitConfig(
            image_size=32, hidden_sizes=[32, 48, 64], num_attention_heads=[2, 3, 4],
            depths=[1, 1, 1], key_dim=[8, 8, 8], num_labels=10))
        for name, p in model.named_parameters():
            if frozen and name.endswith("attention_biases"):
                p.requires_grad_(False)
        return model

    # eight images: over two, a batch norm of one token per image normalises each
    # channel's two values to ±1 whatever they are, and float32 noise decides the sign
    torch.manual_seed(1)
    images, labels = torch.randn(8, 3, 32, 32), torch.tensor([1, 7, 0, 3, 9, 2, 5, 4])
    for frozen in (False, True):
        model = levit(frozen)
        graph = ilp_planner.from_module(model, (images,))
        assert not [n for op in graph.ops for n in op.source_params
                    if n.endswith("attention_biases")]
        reference = levit(frozen)
        plan = ilp_planner.solve(graph, cluster=cluster(1, 1), baselines=False)
        applied = parallelize(plan, model)
        loss = F.cross_entropy(applied(images).logits, labels)
        if not frozen:
            with pytest.raises(RuntimeSetupError, match=r"attention_biases took a gradient "
                                                        r"but no op of the plan owns it"):
                loss.backward()
            continue
        loss.backward()
        want = F.cross_entropy(reference(images).logits, labels)
        want.backward()
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)


def test_a_module_called_with_fewer_inputs_than_its_op_reads_is_named(one_rank):
    """SqueezeBERT's ``matmul_qkv`` module is called with two tensors where the importer's
    attention op reads three (q, k and v through two such modules): the boundary cannot
    convert an input it is not handed. Before: ``IndexError`` in the pre-hook; now one line
    naming the op, the input and the count."""
    import torch
    from transformers import SqueezeBertConfig, SqueezeBertForMaskedLM

    import ilp_planner
    from runtime.apply import parallelize
    from runtime.errors import RuntimeSetupError
    from tests.helpers.hf_apply_check import cluster

    torch.manual_seed(0)
    model = SqueezeBertForMaskedLM(SqueezeBertConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, max_position_embeddings=16, embedding_size=32,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    ids = torch.randint(0, 64, (2, 8))
    plan = ilp_planner.solve(ilp_planner.from_module(model, (ids,)), cluster=cluster(1, 1),
                             baselines=False)
    applied = parallelize(plan, model)
    with pytest.raises(RuntimeSetupError, match=r"op '.*attention\.matmul_qkv' reads "
                                                r"'.*attention\.value' as its input 2, but "
                                                r"its module is called with 2 positional"):
        applied(ids)


def test_every_planned_module_call_must_run_in_the_forward():
    """Mamba-2's mixer convolves with ``causal_conv1d_fn(x, self.conv1d.weight, …)``: the
    plan's op for ``conv1d`` owns its weights, but the module is never called, so no
    boundary runs the op's programs; a module called fewer times than the plan has ops for
    it left an op unrun. Each is named at the end of the first forward (before: nothing
    checked that every planned call ran)."""
    from runtime.applied_hooks import Hook, _check_calls
    from runtime.errors import RuntimeSetupError

    runs = {"conv1d": [Hook("conv1d")], "dropout": [Hook("dropout"), Hook("dropout.dropout")]}
    with pytest.raises(RuntimeSetupError, match=r"module 'conv1d' was not called in the "
                                                r"forward, though the plan has an op for it"):
        _check_calls(runs, {"dropout": 2})
    with pytest.raises(RuntimeSetupError, match=r"module 'dropout' ran 1 of the 2 calls"):
        _check_calls(runs, {"conv1d": 1, "dropout": 1})
    _check_calls(runs, {"conv1d": 1, "dropout": 2})


def test_a_qwen2_moe_on_one_rank_computes_every_routed_token_as_the_block_does(one_rank):
    """On one rank the experts module runs the kernel with every expert local: each
    token's routed copies, sorted by expert, computed and summed back (no exchange), the
    gradients of the router and experts those of the block's own loop."""
    import copy

    import torch
    import torch.nn.functional as F

    import ilp_planner
    from runtime.apply import parallelize
    from tests.helpers.hf_apply_check import MODELS, cluster

    torch.manual_seed(0)
    case = MODELS["qwen2-moe"]()
    ref = copy.deepcopy(case.model)
    plan = ilp_planner.solve(ilp_planner.from_module(case.model, (case.inputs,)),
                             cluster=cluster(1, 1), baselines=False)
    model = parallelize(plan, case.model)
    loss = F.cross_entropy(model(case.inputs).logits.flatten(0, 1), case.targets.flatten())
    want = F.cross_entropy(ref(case.inputs).logits.flatten(0, 1), case.targets.flatten())
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    loss.backward()
    want.backward()
    mlp, ref_mlp = model.model.layers[0].mlp, ref.model.layers[0].mlp
    for name in ("gate.weight", "experts.gate_up_proj", "experts.down_proj"):
        got = mlp.get_parameter(name).grad.full_tensor()
        torch.testing.assert_close(got, ref_mlp.get_parameter(name).grad, rtol=1e-4, atol=1e-6)


def test_a_vocabulary_block_looks_up_its_rows_and_zeroes_the_others():
    import torch

    from runtime.applied_hooks import VocabMask

    table = torch.arange(12.0).reshape(6, 2)
    ids = torch.tensor([[0, 3, 5], [2, 4, 1]])
    parts = []
    for lo, hi in ((0, 3), (3, 6)):
        mask = VocabMask.of(ids, (lo, hi))
        parts.append(mask.apply(torch.nn.functional.embedding(mask.local_ids(ids),
                                                              table[lo:hi])))
    assert torch.equal(parts[0] + parts[1], torch.nn.functional.embedding(ids, table))
    assert VocabMask.of(ids, (3, 6)).local_padding(4) == 1
    assert VocabMask.of(ids, (3, 6)).local_padding(0) is None


def test_styles_keep_the_planned_layouts_up_to_the_loss():
    import torch
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from runtime.tp_styles import to_parallelize_plan
    from tests.helpers.hf_apply_check import MODELS, megatron_plan

    torch.manual_seed(0)
    styles = to_parallelize_plan(megatron_plan(MODELS["llama"](), 1, 4))
    attn = "model.layers.0.self_attn."
    assert {type(styles[attn + p]) for p in ("q_proj", "k_proj", "v_proj")} == {ColwiseParallel}
    assert type(styles[attn + "o_proj"]) is RowwiseParallel
    # the loss reads whole logits: the head sums its partial sums and hands a plain tensor
    head = styles["lm_head"]
    assert head.output_layouts == (Replicate(),) and head.use_local_output
    assert len(styles) == 2 + 7 * 2  # embedding, head, 7 linears per block


def test_plans_no_style_expresses_raise_naming_their_layers():
    import torch

    import ilp_planner
    from ilp_planner.inputs.config import load_config
    from ilp_planner.intra_op.baselines import data_parallel_filter
    from ilp_planner.ir.cluster import MeshAxis
    from ilp_planner.testing import restricted_plan
    from runtime.tp_styles import to_parallelize_plan
    from tests.helpers.hf_apply_check import MODELS, cluster

    torch.manual_seed(0)
    case = MODELS["llama"]()
    graph = ilp_planner.from_module(case.model, (case.inputs,))
    mixed = ilp_planner.solve(graph, cluster=cluster(1, 4), baselines=False)
    four_way = [ly.name for ly in mixed.layers if ly.strategy == "3d(p0=4,p1=1,p2=1)"]
    assert four_way  # 4-way data parallel beside 2 × 2 tensor parallel: no one TP mesh
    with pytest.raises(ValueError, match="does not map") as err:
        to_parallelize_plan(mixed)
    assert f"{four_way[0]} (3d(p0=4,p1=1,p2=1)) runs on a mesh" in str(err.value)
    config = load_config({"model": graph, "cluster": cluster(1, 4)})
    data_parallel = restricted_plan(config, data_parallel_filter(MeshAxis(1, 4)))
    with pytest.raises(ValueError, match="data parallel"):
        to_parallelize_plan(data_parallel)


def test_gpt2s_megatron_plan_maps_its_conv1ds_and_tied_head_onto_styles():
    """GPT-2's ``Conv1D`` stores its weight ``(in, out)``: the plan's column- and row-parallel
    Conv1Ds take :mod:`runtime.planned_styles`' styles. The plan gathers ``c_attn``'s
    output before the attention (its ``[q | k | v]`` column blocks are not whole heads), so
    that style hands the attention whole rows; a dropout following a split layer runs on
    what the style hands its readers. The word table and the head tied to it share one
    :class:`SharedParams`, one column- and one row-parallel: the same hidden-dim split."""
    import torch
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from runtime.planned_styles import PlannedColwise, PlannedRowwise
    from runtime.tp_styles import to_parallelize_plan
    from tests.helpers.hf_apply_check import MODELS, megatron_plan

    torch.manual_seed(0)
    styles = to_parallelize_plan(megatron_plan(MODELS["gpt2"](), 1, 4))
    block = "transformer.h.0."
    c_attn, c_fc, c_proj = (styles[block + p] for p in ("attn.c_attn", "mlp.c_fc", "mlp.c_proj"))
    assert type(c_attn) is PlannedColwise and c_attn.in_out
    assert c_attn.output_layouts == (Replicate(),)  # the attention reads whole heads
    assert type(c_fc) is PlannedColwise and c_fc.output_layouts == (Shard(-1),)
    assert type(c_proj) is PlannedRowwise and c_proj.in_out
    wte, head = styles["transformer.wte"], styles["lm_head"]
    assert isinstance(wte, ColwiseParallel) and isinstance(head, RowwiseParallel)
    assert not wte.in_out and not head.in_out and wte.shared is head.shared is c_fc.shared
    assert wte.output_layouts == (Replicate(),)  # gathered before the dropout, not after
    assert head.output_layouts == (Replicate(),) and head.use_local_output


def test_a_tie_the_styles_cannot_keep_raises_naming_the_head():
    """The plan keeps the word table whole but splits the head tied to it: one parameter
    cannot be both, so no style dict is returned."""
    import torch

    import ilp_planner
    from ilp_planner.inputs.config import load_config
    from ilp_planner.intra_op.baselines import megatron_filter
    from ilp_planner.ir.cluster import MeshAxis
    from ilp_planner.testing import restricted_plan
    from runtime.tp_styles import to_parallelize_plan
    from tests.helpers.hf_apply_check import MODELS, cluster

    torch.manual_seed(0)
    case = MODELS["gpt2"]()
    graph = ilp_planner.from_module(case.model, (case.inputs,), dtensor=False)
    megatron = megatron_filter(MeshAxis(1, 2), MeshAxis(1, 2))

    def whole_table(op, s) -> bool:
        if op.name == "transformer.wte":
            return s.weight is not None and s.weight.split_degree(0) == 1 \
                and s.weight.split_degree(1) == 1
        return megatron(op, s)

    plan = restricted_plan(load_config({"model": graph, "cluster": cluster(1, 4)}), whole_table)
    with pytest.raises(ValueError, match="lm_head is tied to transformer.wte's table") as err:
        to_parallelize_plan(plan)
    assert "row-parallel vs whole on TP" in str(err.value)


def test_t5s_megatron_plan_is_refused_for_its_head_split_position_bias():
    """T5's attention adds its relative position bias for all heads to the scores: on a
    rank holding some heads under the styles the shapes differ, so a plan splitting those
    heads over TP raises naming the attentions; its one table (two embeddings and the tied
    head) is not among the reasons — the encoder's and decoder's lookups take one style
    and the head the other."""
    import torch

    from runtime.tp_styles import to_parallelize_plan
    from tests.helpers.hf_apply_check import megatron_plan, t5

    torch.manual_seed(0)
    with pytest.raises(ValueError, match="adds a learned bias of all heads") as err:
        to_parallelize_plan(megatron_plan(t5(), 1, 4))
    assert "encoder.block.1.layer.0.SelfAttention.attention (" in str(err.value)
    assert "is tied to" not in str(err.value)


def test_conv1d_styles_shard_the_in_out_weight_and_keep_a_shared_table_one(one_rank):
    """On a one-rank TP mesh: the ``(in, out)`` styles place Conv1D's weight on its output
    (column) or input (row) features, and two modules holding one table end with one
    DTensor parameter; a module with no 2-D weight is refused by name."""
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from transformers.pytorch_utils import Conv1D

    from runtime.planned_styles import PlannedColwise, PlannedRowwise, SharedParams

    mesh = DeviceMesh("cpu", [0])
    shared = SharedParams()
    col, row = Conv1D(6, 4), Conv1D(4, 6)
    PlannedColwise(shared=shared, in_out=True)._apply(col, mesh)
    PlannedRowwise(shared=shared, in_out=True)._apply(row, mesh)
    assert col.weight.placements == (Shard(1),) and col.bias.placements == (Shard(0),)
    assert row.weight.placements == (Shard(0),) and row.bias.placements == (Replicate(),)
    emb, head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
    head.weight = emb.weight
    PlannedColwise(shared=shared)._apply(emb, mesh)
    PlannedRowwise(shared=shared)._apply(head, mesh)
    assert head.weight is emb.weight and emb.weight.placements == (Shard(1),)
    with pytest.raises(NotImplementedError, match="LayerNorm has none"):
        PlannedColwise(shared=shared, in_out=True)._apply(nn.LayerNorm(4), mesh)


@pytest.mark.slow
def test_the_hf_example_trains_on_two_nodes_like_one_process():
    res = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               "4", "examples/train_hf_model.py", "--nodes", "2", "--steps", "3"], 600)
    assert res.returncode == 0, f"{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    assert "all ranks: losses match and executed = planned" in res.stdout
    assert res.stdout.count("match") >= 3


def test_a_built_in_moe_plan_is_refused_naming_its_op(one_rank):
    """The runtime's executor runs ``kind: moe`` models; parallelize runs MoE blocks it
    imported from Hugging Face modules and says so for the others, naming the op."""
    from torch import nn

    import ilp_planner
    from runtime.apply import parallelize
    from runtime.errors import RuntimeSetupError

    config = ilp_planner.load_config(CONFIGS / "tiny-moe-cpu.yaml").with_overrides(
        {"cluster.nodes": 1, "cluster.devices_per_node": 1})
    plan = ilp_planner.solve(config, baselines=False)
    with pytest.raises(RuntimeSetupError, match=r"op 'h\.0\.moe' is a built-in mixture"):
        parallelize(plan, nn.Linear(2, 2))
