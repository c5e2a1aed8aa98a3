"""Parallel degrees and the DeviceMesh built from them (plain torch.distributed; no Lightning imports).

:class:`ParallelDims` is the one place that knows how ``world_size`` ranks are split into pipeline (pp),
replicated data parallel (dp_replicate), sharded data parallel / FSDP (dp_shard) and tensor parallel (tp)
groups, and optionally expert parallel (ep) groups borrowed from dp_shard. Degrees are validated when the
object is created (no process group needed); :meth:`ParallelDims.build_mesh` then creates the mesh once.

Layout (row major, tp fastest, so tp peers are neighbouring ranks)::

    world mesh:  ("pp", "dp_replicate", "dp_shard", "tp")     every name present, size-1 axes included
    "dp":        dp_replicate x dp_shard flattened             the batch axes: samples differ along it
    ep > 1:      "dp_shard" split as ("dp_shard_mod_ep", "ep") ep fastest, i.e. experts on nearby ranks

How ep is built on torch 2.13: the world mesh keeps the canonical names and the ep view is made with
``DeviceMesh._unflatten("dp_shard", (dp_shard // ep, ep), ("dp_shard_mod_ep", "ep"))``, which creates the
process groups of both new axes and shares the world mesh's root. The alternative (a world mesh whose dims are
``(..., "dp_shard_mod_ep", "ep", ...)`` with "dp_shard" flattened back) works too, but then every 2-D slice that
mentions "dp_shard" (e.g. the HSDP mesh ``("dp_replicate", "dp_shard")``) is a slice of a flattened dim from
the root mesh, which 2.13 warns is deprecated; keeping "dp_shard" a real dim avoids that. Every combination of
degrees that passes validation can therefore be built; nothing raises ``NotImplementedError``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_mm.validation import is_integer, require_int

__all__ = ["MeshAxis", "MeshSizeError", "ParallelDims", "check_divisible"]


class MeshAxis(str, enum.Enum):
    """Names of the mesh axes; members compare (and hash) equal to their plain string values."""

    PP = "pp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    TP = "tp"
    EP = "ep"

    def __str__(self) -> str:
        return self.value


DP = "dp"  # flattened dp_replicate x dp_shard
DP_SHARD_MOD_EP = "dp_shard_mod_ep"  # the part of dp_shard that is not expert parallel (exists when ep > 1)
WORLD_AXES: tuple[str, ...] = (
    MeshAxis.PP.value,
    MeshAxis.DP_REPLICATE.value,
    MeshAxis.DP_SHARD.value,
    MeshAxis.TP.value,
)

# Constructor field -> argument name of ParallelDims.from_args (and of the future Lightning strategy); errors use
# the latter because that is what the user typed.
_ARG_NAMES = {
    "dp_replicate": "data_parallel_replicate",
    "dp_shard": "data_parallel_shard",
    "tp": "tensor_parallel",
    "pp": "pipeline_parallel",
    "ep": "expert_parallel",
    "world_size": "world_size",
}


def check_divisible(name: str, value: int, divisor_name: str, divisor: int) -> None:
    """Raise ``ValueError`` unless ``divisor`` divides ``value``.

    ``check_divisible("num_attention_heads", 12, "tensor_parallel", 5)`` raises
    ``tensor_parallel=5 must divide num_attention_heads=12 (12 % 5 = 2)``.
    """
    require_int(divisor_name, divisor)
    if not is_integer(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value % divisor:
        raise ValueError(
            f"{divisor_name}={divisor} must divide {name}={value} ({value} % {divisor} = {value % divisor})"
        )


def _normalize_axis(axis: str | MeshAxis) -> str:
    return axis.value if isinstance(axis, MeshAxis) else str(axis)


class MeshSizeError(ValueError, RuntimeError):
    """The parallel degrees do not fit the world size. A ``ValueError`` (a wrong argument) that is also the
    ``RuntimeError`` Lightning's ``ModelParallelStrategy`` raises for it, so either ``except`` clause catches it."""


@dataclass(frozen=True)
class ParallelDims:
    """Parallel degrees over ``world_size`` ranks: ``dp_replicate * dp_shard * tp * pp == world_size``.

    ``dp_shard=-1`` (``"auto"``) takes whatever ``world_size`` leaves; the resolved value is stored, so after
    construction ``dp_shard >= 1``. Expert parallelism does not add ranks: ``ep`` splits the dp_shard axis and
    must divide it. All checks raise ``ValueError`` naming the :meth:`from_args` argument.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    world_size: int = 1
    # Mesh cache, filled by build_mesh; not part of equality, hashing or repr.
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for attr in ("world_size", "dp_replicate", "tp", "pp", "ep"):
            object.__setattr__(self, attr, require_int(_ARG_NAMES[attr], getattr(self, attr)))
        dp_shard = self.dp_shard
        if isinstance(dp_shard, str) and dp_shard.strip().lower() == "auto":
            dp_shard = -1
        dp_shard = require_int("data_parallel_shard", dp_shard, also=("auto", -1))

        others = self.dp_replicate * self.tp * self.pp
        if dp_shard == -1:
            if self.world_size % others:
                raise MeshSizeError(
                    f"data_parallel_shard='auto' needs the world size {self.world_size} to be divisible by "
                    f"data_parallel_replicate * tensor_parallel * pipeline_parallel = {others} "
                    f"({self.dp_replicate} * {self.tp} * {self.pp})"
                )
            dp_shard = self.world_size // others
        product = others * dp_shard
        if product != self.world_size:
            raise MeshSizeError(
                f"data_parallel_replicate * data_parallel_shard * tensor_parallel * pipeline_parallel = {product} "
                f"does not equal the world size {self.world_size} "
                f"({self.dp_replicate} * {dp_shard} * {self.tp} * {self.pp})"
            )
        object.__setattr__(self, "dp_shard", dp_shard)
        if self.ep > 1:
            # ep borrows ranks from dp_shard: experts are sharded over ep, dense parameters over all of dp_shard.
            check_divisible("data_parallel_shard", dp_shard, "expert_parallel", self.ep)

    @classmethod
    def from_args(
        cls,
        world_size: int,
        data_parallel_replicate: int = 1,
        data_parallel_shard: int | str = "auto",
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
        expert_parallel: int = 1,
    ) -> ParallelDims:
        """Build from the user-facing argument names (those of the Lightning strategy)."""
        return cls(
            dp_replicate=data_parallel_replicate,
            dp_shard=data_parallel_shard,  # type: ignore[arg-type]  # "auto" is resolved in __post_init__
            tp=tensor_parallel,
            pp=pipeline_parallel,
            ep=expert_parallel,
            world_size=world_size,
        )

    # ------------------------------------------------------------------ degrees
    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard_enabled

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def fsdp_axes(self) -> tuple[str, ...]:
        """World-mesh axes to hand to ``fully_shard``: 2-D (HSDP) when dp_replicate > 1, else dp_shard alone."""
        if self.dp_replicate_enabled:
            return (MeshAxis.DP_REPLICATE.value, MeshAxis.DP_SHARD.value)
        return (MeshAxis.DP_SHARD.value,)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """World-mesh axes over which samples differ (flattened, they are the "dp" mesh)."""
        return (MeshAxis.DP_REPLICATE.value, MeshAxis.DP_SHARD.value)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Shape of the world mesh, in the order of :data:`WORLD_AXES`."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    # ------------------------------------------------------------------ coordinates (no process group needed)
    def coordinates(self, rank: int) -> dict[str, int]:
        """Index of global ``rank`` on every axis (the layout :meth:`build_mesh` creates)."""
        if not is_integer(rank) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank!r}")
        coords: dict[str, int] = {}
        rest = int(rank)
        for name, size in reversed(tuple(zip(WORLD_AXES, self.mesh_shape, strict=True))):
            rest, coords[name] = divmod(rest, size)
        if self.ep_enabled:
            coords[DP_SHARD_MOD_EP], coords[MeshAxis.EP.value] = divmod(coords[MeshAxis.DP_SHARD.value], self.ep)
        coords[DP] = coords[MeshAxis.DP_REPLICATE.value] * self.dp_shard + coords[MeshAxis.DP_SHARD.value]
        return {name: coords[name] for name in self._available_axes()}

    def data_parallel_rank(self, rank: int | None = None) -> int:
        """Index of this rank (or of global ``rank``) on the flattened batch axes; equal for tp / pp peers."""
        return self.coordinates(self._global_rank() if rank is None else rank)[DP]

    def data_parallel_size(self) -> int:
        """Number of distinct batch shards (= ``dp``)."""
        return self.dp

    def _global_rank(self) -> int:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def _available_axes(self) -> tuple[str, ...]:
        extra = (DP_SHARD_MOD_EP, MeshAxis.EP.value) if self.ep_enabled else ()
        return (*WORLD_AXES, DP, *extra)

    # ------------------------------------------------------------------ nodes
    def axis_span(self, axis: str) -> int:
        """Consecutive global ranks one group of ``axis`` spans (its size times the sizes of the axes inside it):
        ``tp`` -> tp; ``ep`` -> ep x tp (ep is the inner part of dp_shard); ``dp_shard`` -> dp_shard x tp; ..."""
        inner = {"tp": 1, "ep": self.tp, "dp_shard": self.tp, "dp_replicate": self.tp * self.dp_shard}
        inner["pp"] = inner["dp_replicate"] * self.dp_replicate
        sizes = {"tp": self.tp, "ep": self.ep, "dp_shard": self.dp_shard, "dp_replicate": self.dp_replicate}
        sizes["pp"] = self.pp
        if axis not in sizes:
            raise ValueError(f"axis must be one of {sorted(sizes)}, got {axis!r}")
        return sizes[axis] * inner[axis]

    def within_node(self, axis: str, ranks_per_node: int) -> bool:
        """Every group of ``axis`` lies inside one node, when nodes hold ``ranks_per_node`` consecutive ranks (the
        numbering of torchrun and SLURM: global rank = node rank x ranks per node + local rank)."""
        return ranks_per_node % self.axis_span(axis) == 0

    def check_nodes(self, ranks_per_node: int, allow_cross_node: bool = False) -> list[str]:
        """Refuse a mesh whose tensor- or expert-parallel groups would span nodes: their collectives run in every
        layer (TP's all-reduces, EP's all-to-alls) and would cross the slow inter-node link. Raises ``ValueError``
        naming the degrees and the node size; with ``allow_cross_node`` returns the same findings as warnings.
        Data-parallel and pipeline axes may span nodes (HSDP's replicate axis is meant to)."""
        require_int("ranks_per_node", ranks_per_node)
        if self.world_size % ranks_per_node:
            raise ValueError(f"world size {self.world_size} is not a multiple of {ranks_per_node} ranks per node")
        findings = []
        for axis, name, size in (("tp", "tensor_parallel", self.tp), ("ep", "expert_parallel", self.ep)):
            if size > 1 and not self.within_node(axis, ranks_per_node):
                span = self.axis_span(axis)
                findings.append(
                    f"{name}={size} groups span {span} consecutive ranks"
                    + (f" (expert_parallel x tensor_parallel = {self.ep} x {self.tp})" if axis == "ep" else "")
                    + f", which does not fit nodes of {ranks_per_node} devices: its per-layer collectives would cross "
                    f"nodes; choose {name} so that the span divides {ranks_per_node}"
                )
        if findings and not allow_cross_node:
            raise ValueError("; ".join(findings) + " (or pass allow_cross_node_groups=True to run it anyway, slowly)")
        return findings

    def describe_nodes(self, ranks_per_node: int) -> str:
        """E.g. ``"2 nodes x 2 local ranks: dp_shard2 inside nodes, dp_replicate2 across nodes"``."""
        nodes = self.world_size // ranks_per_node
        parts = []
        for axis in ("tp", "ep", "dp_shard", "dp_replicate", "pp"):
            size = getattr(self, axis)
            if size > 1:
                where = "inside nodes" if self.within_node(axis, ranks_per_node) else "across nodes"
                parts.append(f"{axis}{size} {where}")
        layout = ", ".join(parts) if parts else "no parallel axes"
        return f"{nodes} node(s) x {ranks_per_node} local rank(s): {layout}"

    # ------------------------------------------------------------------ mesh
    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """Create (once) and return the world mesh with dims ``("pp", "dp_replicate", "dp_shard", "tp")``.

        Needs an initialised default process group of exactly ``world_size`` ranks, and must be called on every
        rank (it creates process groups). Later calls return the cached mesh.
        """
        if "world" in self._meshes:
            cached = self._meshes["world"]
            if cached.device_type != device_type:
                raise ValueError(
                    f"the mesh was already built for device_type={cached.device_type!r}; "
                    f"cannot rebuild it for device_type={device_type!r}"
                )
            return cached
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "ParallelDims.build_mesh needs an initialised default process group "
                "(torch.distributed.init_process_group)"
            )
        if dist.get_world_size() != self.world_size:
            raise MeshSizeError(
                f"world_size={self.world_size} does not match the process group's world size {dist.get_world_size()}"
            )
        world = init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=WORLD_AXES)
        meshes: dict[str, DeviceMesh] = {name: world[name] for name in WORLD_AXES}
        meshes[DP] = world[self.batch_axes]._flatten(DP)
        if self.ep_enabled:
            split = world._unflatten(
                MeshAxis.DP_SHARD.value, (self.dp_shard // self.ep, self.ep), (DP_SHARD_MOD_EP, MeshAxis.EP.value)
            )
            meshes["ep_view"] = split
            meshes[DP_SHARD_MOD_EP] = split[DP_SHARD_MOD_EP]
            meshes[MeshAxis.EP.value] = split[MeshAxis.EP.value]
        meshes["world"] = world
        self._meshes.update(meshes)
        return world

    @property
    def mesh_built(self) -> bool:
        return "world" in self._meshes

    @property
    def world_mesh(self) -> DeviceMesh:
        return self._require_mesh()["world"]

    def _require_mesh(self) -> dict[str, DeviceMesh]:
        if not self.mesh_built:
            raise RuntimeError("the device mesh is not built yet: call ParallelDims.build_mesh(device_type) first")
        return self._meshes

    def get_mesh(self, axis: str | MeshAxis | tuple[str | MeshAxis, ...]) -> DeviceMesh:
        """1-D mesh of ``axis`` (a world axis, "dp", or "ep" / "dp_shard_mod_ep" when ep > 1).

        A tuple of axes gives the N-D slice of the world mesh (e.g. ``get_mesh(dims.fsdp_axes)``) or, when ep > 1,
        of the ``(pp, dp_replicate, dp_shard_mod_ep, ep, tp)`` view (e.g. ``("dp_replicate", "dp_shard_mod_ep")``
        for the experts' FSDP mesh).
        """
        meshes = self._require_mesh()
        if isinstance(axis, tuple):
            names = tuple(_normalize_axis(a) for a in axis)
            if len(names) == 1:
                return self.get_mesh(names[0])
            for source in (meshes["world"], meshes.get("ep_view")):
                if source is not None and all(name in source.mesh_dim_names for name in names):
                    return source[names]
            raise ValueError(
                f"no mesh has the axes {names}: a tuple must name axes of the world mesh "
                f"{WORLD_AXES}"
                + (f" or of the expert view {meshes['ep_view'].mesh_dim_names}" if self.ep_enabled else "")
            )
        name = _normalize_axis(axis)
        if name not in self._available_axes():
            hint = (
                " ('ep' and 'dp_shard_mod_ep' exist only when expert_parallel > 1)"
                if name in (MeshAxis.EP.value, DP_SHARD_MOD_EP)
                else ""
            )
            raise ValueError(f"unknown mesh axis {name!r}{hint}; available axes: {self._available_axes()}")
        return meshes[name]

    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """Process group of the flattened batch axes ("dp"), or None when there is one batch shard."""
        if not self.dp_enabled:
            return None
        return self.get_mesh(DP).get_group()
