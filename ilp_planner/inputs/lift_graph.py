"""The IR under construction while the importer walks an exported graph.

:class:`DraftGraph` holds the draft ops, the value of every node visited so far and which op
owns each parameter; it names ops after the user's module paths and materialises an
activation as an IR op when a handler needs one to read. The handlers
(:mod:`ilp_planner.inputs.lift_layers`, :mod:`ilp_planner.inputs.lift_elementwise`) build
through it, so naming and parameter ownership are decided in one place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ilp_planner.inputs.lift_backward import StepsBackward
from ilp_planner.inputs.lift_values import (
    CONCATS,
    SPLITS,
    UNARY_FOLDS,
    VIEWS,
    Act,
    Call,
    Const,
    Draft,
    Unsupported,
    dtype_of,
    first_output,
    flatten,
    ir_shape,
    numel,
    op_name,
    tokens_major,
)
from ilp_planner.ir.graph import DTYPE_BYTES, OpKind

_IMAGE_KINDS = (OpKind.CONV2D, OpKind.POOL, OpKind.BATCHNORM)


@dataclass(frozen=True)
class NodeCost:
    """What one node costs as torch counts it: FLOPs (``FlopCounterMode``'s count of the
    node run on its fake tensors) and the bytes of the tensors it reads and writes."""

    flops: float
    bytes_read: int
    bytes_written: int


class Counts(Protocol):
    """What the importer counts with torch: a node's FLOPs and bytes (called), and the
    backward of a set of folded steps as autograd runs it (``backward``: the values they
    read that carry a gradient named by ``trained``)."""

    def __call__(self, node: Any) -> NodeCost: ...

    def backward(self, nodes: Sequence[Any], trained: Callable[[str], bool]
                 ) -> StepsBackward: ...


def _submodule(root: Any, path: str) -> Any:
    """The submodule of ``root`` at ``path``, or None."""
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def _is_leaf(root: Any, path: str) -> bool:
    sub = _submodule(root, path)
    return sub is not None and not any(True for _ in sub.children())


class DraftGraph:
    """Drafts, node values and parameter ownership of one walk over an exported graph;
    ``count`` prices a node the planner cannot shard (the importer counts with torch),
    ``constants`` evaluates constant nodes (attention masks)."""

    def __init__(self, module: Any, count: Counts, strip: str = "",
                 dtensor: bool = True, constants: Any = None):
        self.module = module
        self.count = count
        # the real value of a node no input flows into (a mask), or None where unknown:
        # ``lift_masks.ConstantValues``; without it no mask is proven causal
        self.constants = constants
        self.strip = strip  # the prefix of the loss wrapper's paths (``model.``)
        self.dtensor = dtensor
        self.drafts: dict[str, Draft] = {}
        self.values: dict[str, Any] = {}  # node name -> Const / Act (or a list of them)
        self.param_shape: dict[str, tuple[int, ...]] = {}
        self.owner: dict[str, str] = {}  # parameter FQN -> first op using it
        self.counters: dict[str, int] = {}
        self.outputs: list[Any] = []
        # folded steps already priced (each by the first op absorbing it: a value read by
        # two ops ran its kernels once), and the copies read by the op being built
        self.priced: set[str] = set()
        self.absorbed: list[Any] = []
        self.carrying: set[str] = set()  # drafts known to carry a gradient (_carries)
        # the IR ops the op being built reads through element-wise steps or copies run
        # outside its module (``ir``), and per op the input indices it reads so
        # (``through_code``)
        self.read_outside: set[str] = set()
        self.through_code: dict[str, tuple[int, ...]] = {}

    # -- naming --------------------------------------------------------------------------

    def scope(self, node: Any) -> tuple[tuple[str, str], ...]:
        """The node's module stack as ``(path, class name)``, outermost first."""
        stack = node.meta.get("nn_module_stack") or {}
        out = []
        for path, cls in stack.values():
            path = path.removeprefix(self.strip) if path != self.strip.rstrip(".") else ""
            if path:
                out.append((path, cls if isinstance(cls, str) else getattr(cls, "__name__", "")))
        return tuple(out)

    def _name(self, node: Any, label: str, main: bool) -> str:
        """The module path for a leaf module's own op (``main``); ``<path>.<kind>[_i]``
        otherwise, counted per scope (repeated blocks get the same suffixes), never a
        module's path (Qwen3.5's code convolving with ``self.conv1d.weight``: not the
        uncalled ``conv1d``'s op, whose call ``parallelize`` would await)."""
        scope = self.scope(node)
        path = scope[-1][0] if scope else ""
        if main and path and path not in self.drafts and _is_leaf(self.module, path):
            return path
        base = f"{path}.{label}" if path else label
        n = self.counters.get(base, 0)
        self.counters[base] = n + 1
        name = base if n == 0 else f"{base}_{n}"
        while name in self.drafts or _submodule(self.module, name) is not None:
            n += 1
            self.counters[base] = n + 1
            name = f"{base}_{n}"
        return name

    # -- values --------------------------------------------------------------------------

    def arg(self, a: Any) -> Any:
        """A node argument's value: a visited node's, the literal itself, or a list / tuple
        of them looked up one by one (``cat``'s tensors would otherwise read as constants)."""
        if isinstance(a, (list, tuple)):
            return type(a)(self.arg(x) for x in a)
        name = getattr(a, "name", None)
        return self.values.get(name, Const()) if name is not None else a

    def placeholder(self, node: Any, params: dict[str, str], constants: set[str]) -> Any:
        """A graph input's value: a parameter, a buffer / constant, or a model input."""
        val = node.meta.get("val")
        if node.name in params:
            fqn = params[node.name].removeprefix(self.strip)
            self.param_shape[fqn] = tuple(val.shape)
            return Const((fqn,))
        if node.name in constants or not hasattr(val, "shape"):
            return Const()
        shape = tuple(int(d) for d in val.shape)
        dtype = dtype_of(val)
        spec = shape if len(shape) == 4 else ir_shape(shape, dtype)  # an image as it is
        self.drafts[node.name] = Draft(node.name, OpKind.INPUT, (), spec, dtype)
        return Act((node.name,), shape, dtype)

    # -- building ------------------------------------------------------------------------

    def add(self, node: Any, kind: OpKind, inputs: Sequence[str], shape: Sequence[int],
            dtype: str, *, weight: tuple[int, ...] | None = None, params: Sequence[str] = (),
            flops: float = 0.0, main: bool = True, label: str | None = None,
            **attrs: int) -> Act:
        """A new op; it owns those of ``params`` no earlier op has claimed, and prices the
        folded copies of the values it read (:meth:`ir`, ``attrs.input_steps``)."""
        if self.absorbed:
            attrs = {**attrs, **self.folded(self.absorbed)}
            self.absorbed = []
        name = self._name(node, label or kind.value, main)
        self._record_outside(name, tuple(dict.fromkeys(inputs)))
        owned = tuple(p for p in params if p not in self.owner)
        for p in owned:
            self.owner[p] = name
        shape = tuple(int(d) for d in shape)
        self.drafts[name] = Draft(
            name, kind, tuple(dict.fromkeys(inputs)), shape, dtype, weight,
            sum(numel(self.param_shape[p]) for p in owned), float(flops), dict(attrs), owned,
            self.scope(node))
        return Act((name,), shape, dtype)

    def _record_outside(self, name: str, inputs: tuple[str, ...]) -> None:
        """Note which of op ``name``'s inputs it reads through code run outside its module
        (:meth:`_steps_outside`), for the importer's ``attrs.functional_inputs``; those
        reads are its own (a relayout :meth:`ir` makes for one of several inputs leaves the
        others' to the op reading them)."""
        idx = tuple(i for i, src in enumerate(inputs) if src in self.read_outside)
        if idx:
            self.through_code[name] = idx
        self.read_outside -= set(inputs)

    def _steps_outside(self, node: Any, x: Act) -> bool:
        """Whether a folded step of ``x`` ran in neither the module whose code reads it
        (``node``'s) nor the one of the op it comes from: in a parent's forward, between
        the producer's boundary and the reader's (Granite's ``inputs_embeds *
        embedding_multiplier`` before the first layer's norm). A step inside the producer's
        module (a scaled embedding's own product) runs before its boundary."""
        def within(path: str, module: str) -> bool:
            return bool(module) and (path == module or path.startswith(module + "."))

        def inner(scope: tuple[tuple[str, str], ...]) -> str:
            return scope[-1][0] if scope else ""

        reader = inner(self.scope(node))
        made = [inner(self.drafts[s].scope) for s in x.src if s in self.drafts]
        return any(not within(p, reader) and not any(within(p, m) for m in made)
                   for p in (inner(self.scope(s)) for s in x.steps))

    def adopt(self, draft: Draft, params: Sequence[str]) -> list[str]:
        """Give ``draft`` those of ``params`` no op owns yet (a bias, a position table that
        folds into the op it follows); the ones it took."""
        taken = []
        for p in params:
            if p not in self.owner:
                self.owner[p] = draft.name
                draft.source_params += (p,)
                draft.params += numel(self.param_shape[p])
                taken.append(p)
        return taken

    def folded(self, nodes: Sequence[Any]) -> dict[str, int]:
        """The ``attrs.input_*`` of the folded steps ``nodes`` (:func:`folded_steps`), their
        backward replayed as autograd runs it from the values they read that carry a
        gradient (:meth:`trained`)."""
        return folded_steps(self.count, nodes, self.count.backward(nodes, self.trained))

    def _differentiated(self, name: str) -> bool:
        """Whether an opaque op's backward computes a gradient for node ``name``'s value: an
        activation carrying one (:meth:`trained`) or a value made of parameters."""
        x = self.values.get(name)
        return self.trained(name) or (isinstance(x, Const) and bool(x.params))

    def trains(self, param: str) -> bool:
        """Whether parameter ``param`` (a path in the module) takes a gradient."""
        try:
            return bool(self.module.get_parameter(param).requires_grad)
        except AttributeError:  # a path the module does not resolve: as parameters do
            return True

    def trained(self, name: str) -> bool:
        """Whether node ``name``'s value carries a gradient in training: an activation
        derived from an op owning parameters — not one computed from the inputs alone (a
        mask, RoBERTa's position count from the ids, even in floating point)."""
        x = self.values.get(name)
        return isinstance(x, Act) and any(self._carries(s) for s in x.src)

    def carries(self, names: Sequence[str]) -> bool:
        """Whether any of drafts ``names`` carries a gradient (:meth:`_carries`)."""
        return any(self._carries(n) for n in names)

    def _carries(self, name: str) -> bool:
        """Whether draft ``name`` owns parameters or reads, at any depth, one that does."""
        todo, seen = [name], set()
        while todo:
            n = todo.pop()
            d = self.drafts[n]
            if n in self.carrying or d.params:
                self.carrying.add(name)
                return True
            if n not in seen and d.kind is not OpKind.INPUT:
                seen.add(n)
                todo.extend(d.inputs)
        return False

    def steps_to_price(self, steps: Sequence[Any], copies_only: bool = False) -> list[Any]:
        """The folded steps among ``steps`` (element-wise kernels, copies) no op prices yet,
        now marked priced: the caller's op prices them."""
        fresh = [s for s in dict.fromkeys(steps) if s.name not in self.priced
                 and (is_copy(s) or not copies_only)]
        self.priced.update(s.name for s in fresh)
        return fresh

    def ir(self, node: Any, x: Any, image: bool = False) -> str:
        """The IR op whose output ``x`` is (re-viewed); materialise one if it is not (scores an
        attention does not read: :func:`scores_op`). The steps folded into ``x`` — element-wise
        kernels (a hand-written GELU's pow, tanh, mul; an RMSNorm's pow, mean, rsqrt) and copies
        (a cast, ``contiguous`` of strided data, a ``cat``) — run before the op reading it, which
        prices them (:meth:`add`), or the relayout made here, where there is one: its copies are
        then the copy it stands for, priced instead of its estimate. ``image``: the reader is a
        convolution, reading ``x`` as the ``(b, c, h, w)`` image it is (a relayout keeps it)."""
        own = self.steps_to_price(x.steps) if isinstance(x, Act) else []
        self.absorbed += own
        if isinstance(x, Act) and "qk" in x.parts:
            return scores_op(self, x)
        if isinstance(x, Act) and self._steps_outside(node, x):
            self.read_outside.update(x.src)
        moved_to = _channels_moved(self.drafts[x.src[0]], x) if isinstance(x, Act) else None
        if isinstance(x, Act) and len(x.src) == 1 and moved_to is None:
            d = self.drafts[x.src[0]]
            if numel(d.shape) == numel(x.shape):
                if d.kind is OpKind.INPUT:
                    return d.name
                if d.kind in _IMAGE_KINDS or _is_image(d):
                    if len(x.shape) == 4:
                        return d.name
                    if len(x.shape) == 2 and x.shape[0] == d.shape[0]:
                        # named in its reader's path: a relayout, no later call of it
                        act = self.add(node, OpKind.FLATTEN, [d.name], x.shape, x.dtype,
                                       main=False, relayout=1)
                        return act.src[0]
                elif not image and (len(x.shape) <= 1 or x.shape[-1] == d.shape[-1]):
                    return d.name
        if not isinstance(x, Act):
            raise Unsupported(node, "reads a value that does not depend on the model's inputs")
        part = _fused_part(self.drafts[x.src[0]], x)
        # one linear cut two ways (chunk(2) and chunk(4)): the second cut is a relayout
        if part is not None and self.drafts[x.src[0]].attrs.get("parts", part[1]) == part[1]:
            return self._part(x, *part)
        # a relayout the planner cannot follow: a copy, so no FLOPs, and its bytes once each
        # way — unless the value's own folded copies (absorbed) are that copy
        moved = 0 if any(is_copy(s) for s in own) else numel(x.shape) * DTYPE_BYTES[x.dtype]
        rows = {"rows_local": 1} if _column_pick(self.drafts[x.src[0]], x) else {}
        spec = tuple(x.shape) if image and len(x.shape) == 4 else ir_shape(x.shape, x.dtype)
        if moved_to is not None:  # whole images stay on their devices either way round
            rows = {"rows_local": 1, "row_items": x.shape[0]}
            spec = tokens_major(x.shape) if moved_to == "last" else tuple(x.shape)
        act = self.add(node, OpKind.OPAQUE, list(x.src), spec, x.dtype, main=False,
                       bytes_read=moved, bytes_written=moved, relayout=1, **rows)
        return act.src[0]

    def _part(self, x: Act, index: int, parts: int) -> str:
        """The ``part`` op for column block ``index`` of ``parts`` of a linear's output
        (:func:`_fused_part`), one per block, named in the module splitting it."""
        src = self.drafts[x.src[0]]
        for d in self.drafts.values():
            if d.kind is OpKind.PART and d.inputs == (src.name,) \
                    and (d.attrs["part"], d.attrs["parts"]) == (index, parts):
                return d.name
        src.attrs["parts"] = parts
        act = self.add(x.chain[0][4], OpKind.PART, [src.name], ir_shape(x.shape, x.dtype),
                       x.dtype, main=False, part=index, parts=parts)
        return act.src[0]

    def opaque(self, node: Any, args: list[Any], acts: list[Any], val: Any, op: str) -> Any:
        """An op the planner cannot shard: kept replicated, its inputs gathered; it owns the
        parameters among ``args``, and is priced with torch's own count of its FLOPs and
        bytes (``attrs.bytes_read`` / ``bytes_written``), never a guess — its backward too,
        replayed as autograd runs it (``attrs.bwd`` kernels, ``bwd_bytes``, ``bwd_flops``:
        :func:`~ilp_planner.inputs.lift_backward.replay_backward`, the gradients of the
        activations and the parameters it reads) — but for a custom op torch has no
        backward formula for, which trains nowhere (the compute model's convention then)."""
        out = first_output(val)
        srcs = [self.ir(node, a) for a in acts if isinstance(a, Act)]
        shape = tuple(out.shape)
        spec = opaque_shape(shape, dtype_of(out))
        params = [p for a in flatten(args) if isinstance(a, Const) for p in a.params]
        cost = self.count(node)
        try:
            back = self.count.backward([node], self._differentiated)
            counted = {"bwd": back.kernels, "bwd_bytes": back.bytes, "bwd_flops": back.flops}
        except Unsupported:  # a custom op without a backward formula: the convention's
            counted = {}
        act = self.add(node, OpKind.OPAQUE, srcs, spec, dtype_of(out), params=params,
                       flops=cost.flops, label=op, bytes_read=cost.bytes_read,
                       bytes_written=cost.bytes_written, **counted)
        res = Act(act.src, shape, act.dtype)
        return [res] + [Const() for _ in val[1:]] if isinstance(val, (list, tuple)) else res

    def loss(self, node: Any, x: Act) -> Act:
        """The scalar loss over ``x``: the user's, or the default one the importer adds."""
        src = self.ir(node, x)
        n = numel(self.drafts[src].shape)
        # the user's loss code runs on the output as DTensor sees it: no vocabulary-parallel
        # loss, so the plan gathers split classes before it (strategies.follower_inputs)
        return self.add(node, OpKind.LOSS, [src], (1,), "float32", flops=3.0 * n,
                        **({"whole_classes": 1} if self.dtensor else {}))


def is_copy(node: Any) -> bool:
    """Whether a folded step is a copy — a re-view that moves bytes or a concatenation
    (:func:`ilp_planner.inputs.lift_elementwise.lift_view` keeps only those among the
    re-views) — rather than an element-wise kernel."""
    return op_name(node.target) in VIEWS | CONCATS | {"copy_", "index"}


def _source(node: Any) -> Any:
    """The fake tensor a folded copy reads (``dest.copy_(src)``'s ``src``), or None."""
    arg = node.args[1 if op_name(node.target) == "copy_" else 0] if node.args else None
    return arg.meta.get("val") if hasattr(arg, "meta") else None


def _moved(node: Any, cost: NodeCost) -> int:
    """The bytes a folded step reads and writes: torch's count of its tensors, but for
    ``dest.copy_(src)``, which writes ``dest`` without reading it (torch's count has it
    among the inputs and the outputs)."""
    if op_name(node.target) == "copy_":
        return cost.bytes_read
    return cost.bytes_read + cost.bytes_written


COPY_KINDS = ("cast", "repeat", "layout", "concat")
"""What a folded copy does, as ``explain`` names it (``attrs.input_copies_<kind>``)."""


def copy_kind(node: Any) -> str:
    """A folded copy's kind, from its tensors' meta: ``repeat`` where it writes more
    elements than its input stores (``repeat``, ``repeat_interleave``, GQA's ``expand``
    then ``reshape``), ``cast`` where it changes the dtype, ``concat`` (``cat``,
    ``stack``), else ``layout`` (``clone``, ``contiguous``, a reshape torch cannot view)."""
    if op_name(node.target) in CONCATS:
        return "concat"
    if _repeated(node):
        return "repeat"
    src, out = _source(node), first_output(node.meta["val"])
    return "cast" if src is not None and src.dtype != out.dtype else "layout"


def _repeated(node: Any) -> int:
    """How many more elements a copy writes than its input stores (a broadcast, stride-0
    dim stored once): the adds of a repeat's backward sum; 0 for any other copy."""
    src = _source(node)
    if src is None or not hasattr(src, "stride"):
        return 0
    return max(numel(first_output(node.meta["val"]).shape) - _stored(src), 0)


def copy_backward(node: Any, cost: NodeCost) -> tuple[int, int, int]:
    """(bytes, FLOPs, kernels) of a folded copy's backward, in closed form by its kind
    (:func:`copy_kind`; what autograd runs, checked against torch by
    ``test_folded_copies_backward_is_what_autograd_runs``): a repeat sums the gradient's
    repeats — reads dY, writes dX, one add per repeated element; a cast casts the gradient
    back — reads dY, writes dX; a layout copy and a concatenation pass the gradient on as
    views: nothing — but a broadcast part of a concatenation (MLA's shared rotary key,
    expanded over the heads) sums its slice of the gradient over the repeats."""
    kind = copy_kind(node)
    moved = _moved(node, cost)
    if kind == "repeat":
        return moved, _repeated(node), 1
    if kind == "concat":  # views of dY, but a broadcast part sums its slice over the repeats
        parts = [a.meta["val"] for a in flatten(node.args[:1]) if hasattr(a, "meta")]
        summed = [(numel(t.shape), _stored(t), t.element_size()) for t in parts
                  if _stored(t) < numel(t.shape)]
        return (sum((n + st) * size for n, st, size in summed),
                sum(n - st for n, st, _ in summed), len(summed))
    return (moved, 0, 1) if kind == "cast" else (0, 0, 0)


def _stored(t: Any) -> int:
    """The elements ``t`` stores: a broadcast (stride-0) dim holds one."""
    return numel([d for d, st in zip(t.shape, t.stride(), strict=True) if st != 0])


def opaque_shape(shape: tuple[int, ...], dtype: str) -> tuple[int, ...]:
    """An opaque op's output in the IR: a 4-D value (an image, ``(b, h, t, d)``) as it is,
    any other as :func:`~ilp_planner.inputs.lift_values.ir_shape` (tokens-major) — what a
    linear reading it takes as its ``(tokens, features)`` rows."""
    return shape if len(shape) == 4 else ir_shape(shape, dtype)


def scores_op(g: DraftGraph, x: Act) -> str:
    """Scores (``q @ kᵀ``), or the probabilities made of them, read by an op other than
    an attention — MiniMax's ``(q kᵀ · decay) v``, a learned gate on the probabilities:
    an opaque op computing them from q and k, priced as torch counts the product and
    autograd runs its backward (:meth:`DraftGraph.opaque`'s figures), the softmax and a
    dropout on them since folded into it as steps, their scale and mask too (``x.steps``,
    absorbed by :meth:`DraftGraph.ir`). Before, a relayout copy stood for them: the
    product's FLOPs were priced nowhere."""
    qk = x.parts["qk"]
    made = [x.parts[k] for k in ("softmax", "dropout") if k in x.parts]
    g.absorbed += g.steps_to_price(made)
    cost = g.count(qk)
    back = g.count.backward([qk], g._differentiated)
    # the value as read (``x.shape``: after the re-views folded since the product, such as
    # ``(b, h, t, d) → (b, t, h·d)``) in the IR's form, as any opaque op's
    act = g.add(qk, OpKind.OPAQUE, list(x.src), opaque_shape(tuple(x.shape), x.dtype),
                x.dtype, main=False,
                flops=cost.flops, label="scores", bytes_read=cost.bytes_read,
                bytes_written=cost.bytes_written, bwd=back.kernels, bwd_bytes=back.bytes,
                bwd_flops=back.flops)
    return act.src[0]


def folded_steps(count: Callable[[Any], NodeCost], nodes: Sequence[Any],
                 back: StepsBackward) -> dict[str, int]:
    """What the element-wise steps and copies ``nodes``, folded into the values an op reads,
    cost as kernels of their own (``attrs.input_*``, priced with that op by
    :func:`ilp_planner.lowering.compute_model.folded_work` and named by ``explain``).
    Forward: their number (``input_steps``), the bytes of the tensors each reads and writes
    as torch counts them (``input_steps_bytes``), one FLOP per element an element-wise step
    writes, none for a copy (``input_steps_flops``). Backward (``input_steps_bwd``,
    ``_bwd_bytes``, ``_bwd_flops``): ``back``, what autograd runs for them, counted the
    same way (:func:`ilp_planner.inputs.lift_backward.replay_backward`: tanh's backward
    reads its output and the gradient, pow's is three kernels, an add with a constant
    none, a value two steps read sums two gradients, a slice's gradient is written into a
    zero-filled tensor). The copies among them also apart: ``input_copies``,
    ``input_copies_bytes`` (forward), ``input_copies_bwd_bytes`` (each copy's backward in
    closed form, :func:`copy_backward`), and their number per kind (``input_copies_cast``
    …: :data:`COPY_KINDS`)."""
    costs = [count(n) for n in nodes]
    moved = [_moved(n, c) for n, c in zip(nodes, costs, strict=True)]
    copy = [is_copy(n) for n in nodes]
    flops = sum(numel(first_output(n.meta["val"]).shape)
                for n, k in zip(nodes, copy, strict=True) if not k)
    attrs = {"input_steps": len(nodes), "input_steps_flops": int(flops),
             "input_steps_bytes": sum(moved), "input_steps_bwd": back.kernels,
             "input_steps_bwd_bytes": back.bytes, "input_steps_bwd_flops": back.flops}
    if any(copy):
        kinds = [copy_kind(n) for n, k in zip(nodes, copy, strict=True) if k]
        attrs.update({f"input_copies_{k}": kinds.count(k) for k in COPY_KINDS if k in kinds})
        attrs.update(input_copies=sum(copy),
                     input_copies_bytes=sum(m for m, k in zip(moved, copy, strict=True) if k),
                     input_copies_bwd_bytes=sum(
                         copy_backward(n, c)[0]
                         for n, c, k in zip(nodes, costs, copy, strict=True) if k))
    return attrs


Handler = Callable[[DraftGraph, Call], Any]
"""What the walk's table maps an aten op name to: the node's value from its lifted call."""


def _fused_part(d: Draft, x: Act) -> tuple[int, int] | None:
    """(index, parts) where ``x`` is one of the equal column blocks the user's code cuts a
    linear's output into — its only step a ``chunk`` / ``split`` of the last dim into equal
    parts (Phi-3's ``gate, up = gate_up_proj(x).chunk(2, dim=-1)``) — else None (a cast or
    a view between, unequal parts: a relayout, :meth:`DraftGraph.ir`)."""
    if d.kind is not OpKind.LINEAR or len(x.src) != 1 or len(x.chain) != 1:
        return None
    step = x.chain[0]
    if step[0] not in SPLITS or len(step) < 5 or not step[3] \
            or step[1] != len(x.shape) - 1 or numel(x.shape[:-1]) != d.shape[0]:
        return None
    return step[2], step[3]


def _column_pick(d: Draft, x: Act) -> bool:
    """Whether ``x`` is columns of ``d``'s output, its rows (tokens) untouched — only splits
    and slices of the last dim since (DeepSeek MLA's latent part of ``kv_a_proj_with_mqa``):
    its copy is row-local, so it may split the tokens as its producer does
    (``attrs.rows_local``, :func:`ilp_planner.lowering.strategies.opaque_dims`)."""
    rank = len(x.shape)

    def columns(step: tuple) -> bool:
        return step[0] in (*SPLITS, "slice", "narrow") and len(step) > 1 \
            and isinstance(step[1], int) and step[1] % rank == rank - 1

    picks = [step for step in x.chain if step[0] not in _ROW_LOCAL]
    return bool(picks) and all(columns(step) for step in picks) and len(d.shape) == 2 \
        and numel(x.shape[:-1]) == d.shape[0]


def head_group(d: Draft, x: Act) -> tuple[int, int] | None:
    """``(head width, heads dim)`` where ``x`` is ``d``'s ``(tokens, heads · head_dim)``
    value re-viewed ``(batch, …, heads, head_dim)`` — views keeping ``head_dim`` last,
    transposes of the dims before it (Gemma-3's ``(b, heads, s, d)``), element-wise steps —
    so that a norm over its last dim normalises each head of ``d``'s columns on its own
    (Qwen3's and Gemma-3's ``q_norm`` / ``k_norm``: a norm on ``d`` itself,
    ``attrs.group_width``); the heads dim is where ``x`` holds them (``attrs.heads_dim``,
    for the runtime, which hands the module ``x``). None otherwise."""
    shape, width = x.shape, int(x.shape[-1]) if x.shape else 0
    if len(shape) < 3 or len(d.shape) != 2 or len(x.src) != 1 or numel(shape) != numel(d.shape) \
            or not 0 < width < d.shape[1] or d.shape[1] % width:
        return None
    heads = None
    for step in x.chain:
        if step[0] in ("view", "_unsafe_view", "reshape"):
            dims = step[1] if len(step) > 1 and isinstance(step[1], (list, tuple)) else ()
            if len(dims) != len(shape) or int(dims[-1]) != width:
                return None
            heads = len(dims) - 2
        elif step[0] == "transpose" and heads is not None and len(step) == 3:
            a, b = (int(i) % len(shape) for i in step[1:])
            if len(shape) - 1 in (a, b) or 0 in (a, b):
                return None  # the head dim or the batch moved
            heads = b if heads == a else a if heads == b else heads
        elif step[0] not in _ROW_LOCAL:
            return None
    return None if heads is None else (width, heads)


# chain steps that keep each row to itself: casts, element-wise steps, a last-dim reduction
_ROW_LOCAL = frozenset({"to", "_to_copy", "type_as", "float", "contiguous", "clone",
                        "reduce_last", *UNARY_FOLDS})


def _swaps_last_two(step: tuple) -> bool:
    """Whether a chain step swaps the last two dims of a 3-D value: ``transpose(1, 2)``
    (Segformer's) or ``permute(0, 2, 1)`` (PVT's)."""
    if step[0] == "transpose" and len(step) == 3:
        return {int(step[1]) % 3, int(step[2]) % 3} == {1, 2}
    return step[0] == "permute" and len(step) > 1 and len(step[1]) == 3 \
        and tuple(int(a) % 3 for a in step[1]) == (0, 2, 1)


def _channels_moved(d: Draft, x: Act) -> str | None:
    """``"last"`` where ``x`` is image ``d``'s (N, C, H, W) value with its channels moved
    last — ConvNeXt's ``permute(0, 2, 3, 1)`` before its layer norm and pointwise linears,
    which read it as (N·H·W, C) tokens — ``"first"`` where tokens ``d``'s (N, H, W, C)
    value has them moved back (``permute(0, 3, 1, 2)``, or a (N, H·W, C) sequence's
    ``transpose(1, 2)`` reshaped to (N, C, H, W): Segformer's) for a convolution or an
    image's residual add; None otherwise. Either is a copy, not a re-view: its op (:meth:`ir`) keeps
    whole images together (a split of the N·H·W rows by a divisor of N, ``row_items``)."""
    if len(x.shape) != 4 or len(x.src) != 1:
        return None
    n, a, b, z = x.shape
    swaps = [step for step in x.chain if step[0] in ("transpose", "permute")]
    if len(swaps) == 1 and _swaps_last_two(swaps[0]) \
            and d.shape == (n * b * z, a):  # (B, N, C) tokens → (B, C, N) → (B, C, H, W)
        return "first"  # Segformer's, PVT's spatial reduction before its convolution
    perms = [tuple(int(a) % 4 for a in step[1]) for step in x.chain
             if step[0] == "permute" and len(step) > 1 and len(step[1]) == 4]
    if len(perms) != 1:
        return None
    if perms[0] == (0, 2, 3, 1) and d.shape == (n, z, a, b):  # x is (N, H, W, C)
        return "last"
    if perms[0] == (0, 3, 1, 2) and d.shape == (n * b * z, a):  # x is (N, C, H, W)
        return "first"
    return None


def _is_image(d: Draft) -> bool:
    return len(d.shape) == 4 and d.kind is not OpKind.INPUT
