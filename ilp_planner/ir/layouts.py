"""SBP layouts: one placement per mesh axis — Split(d), Broadcast or Partial.

Placements are tiny frozen values with a machine ``repr`` and a human ``str`` (``S(0)``,
``B``, ``P``). A :class:`Layout` pairs them with a mesh factorisation. When several axes
split the same tensor dimension, the lower-numbered axis is the major one (DTensor's and
GSPMD's convention: ``S^{01}`` = split by axis 0, then each piece by axis 1).

Conversions: :meth:`Layout.to_gspmd` / :meth:`Layout.from_gspmd` (``S^0R``, ``S^{01}R``;
``S0RR`` also accepted), :meth:`Layout.to_dtensor` / :meth:`Layout.from_dtensor`
(``Shard(d)``, ``Replicate()``, ``Partial()``; torch imported lazily so the IR stays
torch-free).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ilp_planner.errors import LayoutError
from ilp_planner.ir.cluster import Factorisation, MeshAxis, axis_coordinates, fact_str
from ilp_planner.ir.graph import TensorSpec


@dataclass(frozen=True)
class Split:
    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Broadcast:
    def __str__(self) -> str:
        return "B"


@dataclass(frozen=True)
class Partial:
    def __str__(self) -> str:
        return "P"


Placement = Split | Broadcast | Partial
B = Broadcast()
P = Partial()


def S(dim: int) -> Split:
    return Split(dim)


def parse_placement(text: str) -> Placement:
    """Inverse of ``str``: ``S(1)`` / ``B`` / ``P`` (also ``S1``)."""
    t = text.strip()
    if t == "B":
        return B
    if t == "P":
        return P
    m = re.fullmatch(r"S\(?(\d+)\)?", t)
    if m:
        return Split(int(m.group(1)))
    raise LayoutError(f"cannot parse placement {text!r}; expected S(d), B or P")


@dataclass(frozen=True)
class Layout:
    """A tensor layout: ``placements[i]`` is the state of the tensor along mesh axis ``i``."""

    fact: Factorisation
    placements: tuple[Placement, ...]

    def __post_init__(self) -> None:
        if len(self.fact) != len(self.placements):
            raise LayoutError(
                f"layout has {len(self.placements)} placements for a {len(self.fact)}-axis mesh "
                f"{fact_str(self.fact)}"
            )

    @classmethod
    def replicated(cls, fact: Factorisation) -> Layout:
        return cls(fact, tuple(B for _ in fact))

    @property
    def num_devices(self) -> int:
        return math.prod(a.size for a in self.fact)

    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.fact, self.placements))
            self.__dict__["_hash"] = h
        return h

    @cached_property
    def _degrees(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for a, pl in zip(self.fact, self.placements, strict=True):
            if isinstance(pl, Split):
                out[pl.dim] = out.get(pl.dim, 1) * a.size
        return out

    def split_degree(self, dim: int) -> int:
        return self._degrees.get(dim, 1)

    @cached_property
    def _split_axes(self) -> dict[int, tuple[int, ...]]:
        out: dict[int, tuple[int, ...]] = {}
        for i, pl in enumerate(self.placements):
            if isinstance(pl, Split):
                out[pl.dim] = (*out.get(pl.dim, ()), i)
        return out

    def split_axes(self, dim: int) -> tuple[int, ...]:
        """Mesh axes splitting ``dim``, major first (hot in the lowering: computed once)."""
        return self._split_axes.get(dim, ())

    @cached_property
    def partial_axes(self) -> tuple[int, ...]:
        return tuple(i for i, pl in enumerate(self.placements) if isinstance(pl, Partial))

    @property
    def replica_degree(self) -> int:
        return math.prod(a.size for a, pl in zip(self.fact, self.placements, strict=True)
                         if isinstance(pl, Broadcast))

    @property
    def has_partial(self) -> bool:
        return bool(self.partial_axes)

    def check(self, tensor: TensorSpec) -> None:
        """Raise if a split names a dimension the tensor lacks or splits finer than its size."""
        for i, pl in enumerate(self.placements):
            if isinstance(pl, Split) and not 0 <= pl.dim < tensor.rank:
                raise LayoutError(
                    f"mesh axis {i} splits dim {pl.dim} but the tensor {tensor.shape} has rank "
                    f"{tensor.rank}"
                )
        for d in range(tensor.rank):
            if self.split_degree(d) > tensor.shape[d]:
                raise LayoutError(
                    f"dim {d} of size {tensor.shape[d]} cannot be split {self.split_degree(d)} ways"
                )

    def is_even(self, tensor: TensorSpec) -> bool:
        return all(tensor.shape[d] % self.split_degree(d) == 0 for d in range(tensor.rank))

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Largest local shard (ceil division, as torch.chunk gives for uneven splits)."""
        return tuple(-(-s // self.split_degree(d)) for d, s in enumerate(shape))

    def local_bytes(self, tensor: TensorSpec) -> float:
        """Bytes held per device (exact fraction; padding of uneven splits ignored) — the
        memory model's figure. Communication is priced on :meth:`padded_shape`."""
        return tensor.nbytes / math.prod(self._degrees.values())

    def regions(self, shape: tuple[int, ...]) -> np.ndarray:
        """``(devices, rank, 2)`` array: the ``[lo, hi)`` block of every mesh-ordered device.

        Chunking follows ``torch.chunk`` (chunk size ⌈n/k⌉, trailing chunks short or empty),
        nested major-first when several axes split one dim: each axis chunks the block its
        more major axes left. This is the geometry the runtime executes; uneven shapes
        differ between a flat split by k and a nested split by k1·k2."""
        coords = axis_coordinates(self.fact)
        out = np.zeros((coords.shape[0], len(shape), 2), dtype=np.int64)
        for d, n in enumerate(shape):
            lo = np.zeros(coords.shape[0], dtype=np.int64)
            size = np.full(coords.shape[0], n, dtype=np.int64)
            for a in self.split_axes(d):
                k = self.fact[a].size
                c = -(-size // k)
                start = np.minimum(coords[:, a] * c, size)
                size = np.minimum(size - start, c)
                lo = lo + start
            out[:, d, 0] = lo
            out[:, d, 1] = lo + size
        return out

    def padded_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The largest local block per dim: every collective pads local pieces to it, so
        every rank moves the same bytes (what the plan prices)."""
        out = []
        for d, n in enumerate(shape):
            size = n
            for a in self.split_axes(d):
                size = -(-size // self.fact[a].size)
            out.append(size)
        return tuple(out)

    # ---- string forms -------------------------------------------------------------------
    def sbp(self) -> str:
        """Compact SBP string, e.g. ``S(0)BP``."""
        return "".join(str(p) for p in self.placements)

    def __str__(self) -> str:
        return "(" + ", ".join(f"{pl}:{ax}" for pl, ax in zip(self.placements, self.fact, strict=True)) + ")"

    def to_gspmd(self, rank: int) -> str:
        """GSPMD/Alpa spec: one token per tensor dim, ``S^{axes}`` or ``R``."""
        if self.has_partial:
            raise LayoutError(f"layout {self} has a partial-sum axis, which GSPMD specs cannot express")
        tokens = []
        for d in range(rank):
            axes = self.split_axes(d)
            if not axes:
                tokens.append("R")
            elif len(axes) == 1:
                tokens.append(f"S^{axes[0]}")
            else:
                tokens.append("S^{" + "".join(str(a) for a in axes) + "}")
        for i, pl in enumerate(self.placements):
            if isinstance(pl, Split) and pl.dim >= rank:
                raise LayoutError(f"mesh axis {i} splits dim {pl.dim} but the rank is {rank}")
        return "".join(tokens)

    @classmethod
    def from_gspmd(cls, spec: str, fact: Factorisation, rank: int | None = None) -> Layout:
        """Parse ``S^0R``, ``S^{01}RR``, ``S0RR`` or ``S01R`` against a mesh factorisation."""
        tokens = re.findall(r"S\^\{(\d+)\}|S\^(\d)|S(\d+)|(R)|(.)", spec.replace(" ", ""))
        per_dim: list[tuple[int, ...]] = []
        for braced, caret, bare, rep, bad in tokens:
            if bad:
                raise LayoutError(f"spec {spec!r}: unexpected character {bad!r}; use S^0, S^{{01}} or R")
            if rep:
                per_dim.append(())
            else:
                digits = braced or caret or bare
                per_dim.append(tuple(int(c) for c in digits))
        if rank is not None and len(per_dim) != rank:
            raise LayoutError(
                f"spec {spec!r} has {len(per_dim)} dims but the tensor has rank {rank}"
            )
        placements: list[Placement] = [B] * len(fact)
        for d, axes in enumerate(per_dim):
            if list(axes) != sorted(axes):
                raise LayoutError(f"spec {spec!r}: axes of dim {d} must be listed major first (S^{{01}})")
            for a in axes:
                if a >= len(fact):
                    raise LayoutError(
                        f"spec {spec!r} names mesh axis {a} but the mesh {fact_str(fact)} has "
                        f"{len(fact)} axes"
                    )
                if placements[a] != B:
                    raise LayoutError(f"spec {spec!r} uses mesh axis {a} twice")
                placements[a] = Split(d)
        return cls(fact, tuple(placements))

    def to_dtensor(self) -> list:
        """DTensor placements (``Shard``, ``Replicate``, ``Partial``) in mesh-axis order."""
        from torch.distributed.tensor import Partial as TPartial
        from torch.distributed.tensor import Replicate, Shard

        out = []
        for pl in self.placements:
            if isinstance(pl, Split):
                out.append(Shard(pl.dim))
            elif isinstance(pl, Broadcast):
                out.append(Replicate())
            else:
                out.append(TPartial())
        return out

    @classmethod
    def from_dtensor(cls, placements: list, fact: Factorisation) -> Layout:
        from torch.distributed.tensor import Partial as TPartial
        from torch.distributed.tensor import Replicate, Shard

        out: list[Placement] = []
        for pl in placements:
            if isinstance(pl, Shard):
                out.append(Split(pl.dim))
            elif isinstance(pl, Replicate):
                out.append(B)
            elif isinstance(pl, TPartial):
                out.append(P)
            else:
                raise LayoutError(f"unsupported DTensor placement {pl!r}")
        return cls(fact, tuple(out))

    # ---- canonical form -------------------------------------------------------------------
    @cached_property
    def _blocks(self) -> np.ndarray:
        coords = axis_coordinates(self.fact)
        rank = 1 + max((pl.dim for pl in self.placements if isinstance(pl, Split)), default=-1)
        blocks = np.zeros((coords.shape[0], max(rank, 1)), dtype=np.int64)
        for i, pl in enumerate(self.placements):
            if isinstance(pl, Split):
                blocks[:, pl.dim] = blocks[:, pl.dim] * self.fact[i].size + coords[:, i]
        return blocks

    def block_key(self, shape: tuple[int, ...]) -> tuple:
        """For a P-free layout: equal for two layouts of the same devices (any
        factorisation) exactly when every device holds the same block of a tensor of
        ``shape`` — so a re-view between them moves nothing. Even splits compare block
        indices; uneven ones the real regions (flat and nested chunking differ there)."""
        if all(shape[d] % self.split_degree(d) == 0 for d in range(len(shape))):
            return ("even",) + self.canonical_key()
        return ("regions", self.regions(shape).tobytes())

    def canonical_key(self) -> tuple:
        """For a P-free layout: a key equal for two layouts (of the same devices, any
        factorisation) exactly when every device holds the same block of the tensor."""
        key = self.__dict__.get("_canonical_key")
        if key is None:  # baseline filters ask it of every strategy of every member
            if self.has_partial:
                raise LayoutError("canonical_key is defined for layouts without partial sums")
            rank = self._blocks.shape[1]
            degrees = tuple(self.split_degree(d) for d in range(rank))
            while degrees and degrees[-1] == 1:
                degrees = degrees[:-1]
            key = self.__dict__["_canonical_key"] = (
                degrees, self._blocks[:, : len(degrees)].tobytes())
        return key


def drop_unit_axes(layout: Layout) -> Layout:
    """The same layout without size-1 mesh axes (they carry no data distribution)."""
    keep = [i for i, a in enumerate(layout.fact) if a.size > 1]
    if len(keep) == len(layout.fact):
        return layout
    if not keep:
        return Layout((MeshAxis(1, 1),), (B,))
    return Layout(tuple(layout.fact[i] for i in keep), tuple(layout.placements[i] for i in keep))


def grad_layout(layout: Layout) -> Layout:
    """The layout a value's gradient must arrive in for the value's producer: partial sums
    become replicas (the gradient of every summand is the gradient of the sum), splits and
    replicas stay. Every backward program ends in this layout."""
    if not layout.has_partial:
        return layout
    return Layout(layout.fact, tuple(B if isinstance(pl, Partial) else pl for pl in layout.placements))
