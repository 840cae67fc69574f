"""`ParallelDims`: the one place that validates parallel degrees and builds the device meshes.

    dims = ParallelDims.build(world_size=8, dp_shard=-1, ep=4, cp=2, num_experts=64)
    dims.dp_shard, dims.ep_enabled            # 4, True
    meshes = dims.build_meshes("cuda")        # after init_process_group

Rank layout (row-major, last axis fastest): the world is (dp_replicate, dp_shard, cp), so the CP
ranks of one sequence are neighbours. Three meshes view the same ranks:

- `world`  (dp_replicate, dp_shard, cp): which batch a rank reads (dp) and which chunk (cp).
- `fsdp`   (dp_replicate, dp_shard_cp): dense weights are sharded over dp_shard * cp (CP ranks
  see different tokens of the same sequences, so their gradients are summed like DP ranks'), and
  replicated over dp_replicate (HSDP).
- `expert` (dp_replicate, expert_shard, ep): EP borrows ep ranks from dp_shard * cp; an expert
  weight is split over `ep` by expert and FSDP-sharded over what is left, expert_shard =
  dp_shard * cp / ep.

Everything is checked in `build`, before any process group exists, with errors that name the
constraint and the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncrl.config.parallel import ParallelConfig

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Meshes", "ParallelDims", "ParallelDimsError"]


class ParallelDimsError(ValueError):
    """Parallel degrees that do not fit the world size, the model, or each other."""


@dataclass(frozen=True, kw_only=True)
class Meshes:
    world: DeviceMesh  # (dp_replicate, dp_shard, cp)
    fsdp: DeviceMesh  # (dp_replicate, dp_shard_cp); HSDP when dp_replicate > 1
    expert: DeviceMesh | None  # (dp_replicate, expert_shard, ep); None when EP is off

    @property
    def expert_fsdp(self) -> DeviceMesh:
        """The mesh expert weights are FSDP-sharded on: (dp_replicate, expert_shard)."""
        assert self.expert is not None, "EP is off"
        return self.expert["dp_replicate", "expert_shard"]


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Resolved, validated parallel degrees. `world_size == dp_replicate * dp_shard * cp`."""

    world_size: int
    dp_replicate: int
    dp_shard: int
    ep: int
    cp: int

    @classmethod
    def build(
        cls,
        *,
        world_size: int,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        ep: int = 1,
        cp: int = 1,
        num_experts: int = 0,
    ) -> ParallelDims:
        """Resolve `dp_shard = -1` and validate every degree; see the module docstring."""
        for name, value in (
            ("world_size", world_size),
            ("dp_replicate", dp_replicate),
            ("ep", ep),
            ("cp", cp),
        ):
            if value < 1:
                raise ParallelDimsError(f"{name} must be >= 1, got {value}")
        if dp_shard == -1:
            if world_size % (dp_replicate * cp):
                raise ParallelDimsError(
                    f"dp_shard = -1 (auto) needs world_size ({world_size}) divisible by "
                    f"dp_replicate * cp = {dp_replicate} * {cp} = {dp_replicate * cp}"
                )
            dp_shard = world_size // (dp_replicate * cp)
        elif dp_shard < 1:
            raise ParallelDimsError(f"dp_shard must be >= 1 or -1 (auto), got {dp_shard}")
        if dp_replicate * dp_shard * cp != world_size:
            raise ParallelDimsError(
                f"dp_replicate * dp_shard * cp = {dp_replicate} * {dp_shard} * {cp} = "
                f"{dp_replicate * dp_shard * cp} must equal world_size ({world_size})"
            )
        dims = cls(world_size=world_size, dp_replicate=dp_replicate, dp_shard=dp_shard, ep=ep, cp=cp)
        dims._check_ep(num_experts)
        return dims

    @classmethod
    def from_config(cls, cfg: ParallelConfig, *, world_size: int, num_experts: int) -> ParallelDims:
        """`[trainer.parallel]` + the launched world size + the model's expert count."""
        return cls.build(
            world_size=world_size,
            dp_replicate=cfg.dp_replicate,
            dp_shard=cfg.dp_shard,
            ep=cfg.ep,
            cp=cfg.cp,
            num_experts=num_experts,
        )

    def _check_ep(self, num_experts: int) -> None:
        if self.ep == 1:
            return
        if num_experts <= 0:
            raise ParallelDimsError(f"ep = {self.ep} needs an MoE model, but the model has no experts")
        if num_experts % self.ep:
            raise ParallelDimsError(
                f"ep ({self.ep}) must divide num_experts ({num_experts}) so every EP rank holds "
                f"the same number of experts"
            )
        if (self.dp_shard * self.cp) % self.ep:
            raise ParallelDimsError(
                f"ep ({self.ep}) borrows its ranks from dp_shard * cp = {self.dp_shard} * {self.cp} = "
                f"{self.dp_shard * self.cp}, so it must divide that product"
            )

    # -- questions everybody asks (nobody else recomputes degrees) ------------------------------
    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def dp_size(self) -> int:
        """Number of distinct batches per step (ranks of one CP group read the same batch)."""
        return self.dp_replicate * self.dp_shard

    @property
    def expert_shard(self) -> int:
        """FSDP degree of expert weights within a replica: what dp_shard * cp leaves after EP."""
        return self.dp_shard * self.cp // self.ep

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_replicate, dp_shard, cp) coordinates of a global rank."""
        cp_rank = rank % self.cp
        shard = (rank // self.cp) % self.dp_shard
        return rank // (self.cp * self.dp_shard), shard, cp_rank

    def dp_rank(self, rank: int) -> int:
        """Which of the `dp_size` batches this rank reads."""
        replica, shard, _ = self.coords(rank)
        return replica * self.dp_shard + shard

    def cp_rank(self, rank: int) -> int:
        return self.coords(rank)[2]

    def build_meshes(self, device_type: str) -> Meshes:
        """Create the three meshes (collective: every rank calls this, in the same order)."""
        import torch  # here: the layout arithmetic above imports without torch (the launcher's checks)
        from torch.distributed.device_mesh import DeviceMesh

        ranks = torch.arange(self.world_size)
        world = DeviceMesh(
            device_type,
            ranks.view(self.dp_replicate, self.dp_shard, self.cp),
            mesh_dim_names=("dp_replicate", "dp_shard", "cp"),
        )
        fsdp = DeviceMesh(
            device_type,
            ranks.view(self.dp_replicate, self.dp_shard * self.cp),
            mesh_dim_names=("dp_replicate", "dp_shard_cp"),
        )
        expert = None
        if self.ep_enabled:
            expert = DeviceMesh(
                device_type,
                ranks.view(self.dp_replicate, self.expert_shard, self.ep),
                mesh_dim_names=("dp_replicate", "expert_shard", "ep"),
            )
        return Meshes(world=world, fsdp=fsdp, expert=expert)
