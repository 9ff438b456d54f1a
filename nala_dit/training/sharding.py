"""FSDP2: the weights, their gradients, AdamW's moments and the EMA sharded over the processes.

``train.py --fsdp`` (or ``accelerate launch --config_file configs/accelerate/fsdp2.yaml``,
which sets ``ACCELERATE_USE_FSDP=true`` and ``FSDP_VERSION=2``) shards every parameter of
the model over the processes with torch's ``fully_shard``: one unit per DiT block, the
embedders and the final layer in the root unit (what accelerate's FSDP2 plugin does with
``fsdp_transformer_layer_cls_to_wrap: DiTBlock``), so a process holds 1/P of the weights,
gradients, AdamW state and EMA and all-gathers one block's weights at a time.

The mesh is 2-D, ``("dp", "cp")``: data-parallel groups × the P processes of a
context-parallel group (``--context-parallel P``; consecutive ranks, as
``attention/context_parallel.py`` lays them out). The shards span both dimensions (the
mesh flattened: a context-parallel group's processes hold the same weights, so they
shard them too), the gradients are averaged over all of them (reduce-scatter), as DDP
averages over the world, and NaLa's state is all-reduced over ``cp`` only.

Mixed precision is a policy: ``--mixed-precision bf16`` computes with bf16 copies of the
weights and reduces gradients in fp32 (``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``); the sharded weights, AdamW and the EMA stay fp32, and NaLa's state and
normaliser are fp32 whatever the input (``attention/nala/fused.py``).

Why not ``accelerator.prepare``: accelerate 1.15 turns FSDP on only for GPU-like distributed
types (``AcceleratorState``: ``MULTI_GPU``, ``MULTI_XPU``, ...): on CPU processes (gloo) its
state stays ``MULTI_CPU`` and ``prepare`` would wrap the model in DDP. torch's ``fully_shard``
runs on both, so the trainer calls it itself, on every device, and the CPU tests check the
path a GPU run takes. Accelerate still launches the processes (on CPUs too, with
``ACCELERATE_USE_CPU=1`` as for any multi-process CPU run), sets up the process group,
gathers, and reads its config file (the ``FSDP_*`` variables it exports).

Checkpoints (``save`` / ``restore``): ``<step>/shards/`` holds model, EMA, optimizer (and REPA's
projector) as one ``torch.distributed.checkpoint`` written by every process, beside the usual
``state.json`` and ``rng.safetensors``; the folder is written under a temporary name and
renamed, as ``checkpoint.save_checkpoint`` does. ``checkpoint.Checkpoint`` reads a sharded
checkpoint's weights and optimizer on one process (``read_shards``), so ``sample.py``,
``export.py`` and the pipelines take one unchanged; ``consolidate.py`` writes the usual
single-file checkpoint of one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoints.shards import SHARDS, ShardIndexError, by_name, load_sharded

LAUNCHER_FLAG = "ACCELERATE_USE_FSDP"


def fsdp_from_launcher(environ=os.environ) -> bool:
    """Whether ``accelerate launch`` was given an FSDP config (``--config_file
    configs/accelerate/fsdp2.yaml`` or ``--use_fsdp``); FSDP1 is refused (this trainer shards
    with FSDP2's ``fully_shard``)."""
    if environ.get(LAUNCHER_FLAG, "false").lower() != "true":
        return False
    if (version := environ.get("FSDP_VERSION", "1")) != "2":
        raise ValueError(f"the accelerate config asks for FSDP version {version}: train.py shards with FSDP2; set "
                         f"fsdp_version: 2 in it (as configs/accelerate/fsdp2.yaml does) or pass --fsdp_version 2")
    return True


def reshard_after_forward(environ=os.environ) -> bool:
    """The accelerate config's ``fsdp_reshard_after_forward`` (default true: free each block's
    gathered weights after its forward and gather them again in backward)."""
    return environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() != "false"


def check_fsdp(world: int, mixed_precision: str, context_parallel: int = 1) -> None:
    """What FSDP cannot do here, and a mesh that does not fit, refused before anything is built."""
    if world < 2:
        raise ValueError("--fsdp shards the model over processes, and this run has one: launch 2 or more "
                         "(accelerate launch --num_processes N train.py --fsdp ...), or drop --fsdp")
    if mixed_precision == "fp16":
        raise ValueError("--fsdp with --mixed-precision fp16 needs a sharded loss scaler, which this trainer does not "
                         "have: use --mixed-precision bf16 (no scaler needed) or no")
    if world % context_parallel:
        raise ValueError(f"--context-parallel {context_parallel} must divide the number of processes ({world}): "
                         f"launch a multiple of {context_parallel} processes or pick a divisor of {world}")


class Sharding:
    """This run's FSDP2 mesh and what a sharded run does differently: shard, sync, clip,
    check, save and restore."""

    def __init__(self, device: torch.device, context_parallel: int, mixed_precision: str, reshard: bool = True):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        check_fsdp(world, mixed_precision, context_parallel)
        self.world, self.context_size, self.reshard = world, context_parallel, reshard
        self.mesh = init_device_mesh(device.type, (world // context_parallel, context_parallel),
                                     mesh_dim_names=("dp", "cp"))
        self.shard_mesh = self.mesh["dp", "cp"]._flatten("dp_cp")   # the shards span both dimensions
        self.policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                       if mixed_precision == "bf16" else MixedPrecisionPolicy())

    def context(self):
        """The ``ContextParallel`` handle of this process: its group is the mesh's ``cp`` row."""
        from ..attention.context_parallel import ContextParallel

        cp, dp = self.mesh["cp"], self.mesh["dp"]
        group = cp.get_group() if self.context_size > 1 else None
        return ContextParallel(self.context_size, cp.get_local_rank(), group, dp.get_local_rank(), dp.size())

    def describe(self) -> str:
        shape = f"{self.world // self.context_size} data-parallel × {self.context_size} context-parallel"
        precision = "bf16 compute, fp32 reduction" if self.policy.param_dtype is not None else "fp32"
        return (f"fsdp: parameters, gradients, AdamW state and EMA sharded over {self.world} processes "
                f"(mesh {shape}); one unit per block, {precision}"
                f"{'' if self.reshard else ', weights kept gathered between forward and backward'}")

    # ---------------------------------------------------------------- modules
    def shard(self, module: torch.nn.Module, train: bool = True) -> torch.nn.Module:
        """``fully_shard`` each DiT block, then the rest as the root unit (in place).
        ``train=False`` (the EMA): fp32, never a mixed-precision copy."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = self.policy if train else MixedPrecisionPolicy()
        for block in getattr(module, "blocks", ()):
            fully_shard(block, mesh=self.shard_mesh, mp_policy=policy, reshard_after_forward=self.reshard)
        fully_shard(module, mesh=self.shard_mesh, mp_policy=policy, reshard_after_forward=self.reshard)
        return module

    @staticmethod
    def broadcast(module: torch.nn.Module) -> None:
        """Rank 0's weights and buffers on every process (DDP does this when it wraps a
        model; sharding would otherwise keep each rank's own initialisation of its shard)."""
        for t in (*module.parameters(), *module.buffers()):
            dist.broadcast(t.data, src=0)

    @staticmethod
    def no_sync(module: torch.nn.Module, sync: bool):
        """Gradient accumulation: no reduce-scatter before the last micro-batch."""
        if sync:
            return contextlib.nullcontext()

        @contextlib.contextmanager
        def unsynced():
            module.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                module.set_requires_gradient_sync(True)
        return unsynced()

    @staticmethod
    def clip(parameters, max_norm: float) -> torch.Tensor:
        """The global 2-norm of the sharded gradients (one all-reduce of the shards' squared
        sums), clipped to ``max_norm`` when it is > 0; a plain tensor on every process."""
        from torch.distributed.tensor import DTensor

        params = [p for p in parameters if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        return norm

    # ---------------------------------------------------------------- checkpoints
    @staticmethod
    def _container(model, projector):
        """The module whose parameter names key the optimizer state: the model's own names,
        ``model.`` / ``projector.`` with REPA."""
        if projector is None:
            return model
        return torch.nn.ModuleDict(dict(model=model, projector=projector))

    def _state(self, model, ema, optimizer, projector) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state = dict(model=model.state_dict(), ema=ema.state_dict(),
                     optimizer=get_optimizer_state_dict(self._container(model, projector), optimizer))
        if projector is not None:
            state["projector"] = projector.state_dict()
        return state

    def save(self, ckpt_dir: Path, state: dict, rng_states, model, ema, optimizer, projector=None,
             keep_last: int = 0) -> Path:
        """Every process writes its shards into ``ckpt_dir/<step>/shards`` (under a temporary
        name), rank 0 the state and RNG files, then renames the folder into place."""
        import torch.distributed.checkpoint as dcp
        from safetensors.torch import save_file

        from ..guards import durable_replace
        from .checkpoint import STATE, TMP_PREFIX, list_checkpoints

        step = state["step"]   # the weights were checked finite (``loop.checkpoint``)
        final = Path(ckpt_dir) / f"{step:07d}"
        tmp = Path(ckpt_dir) / f"{TMP_PREFIX}sharded-{final.name}"   # one name for all processes
        main = dist.get_rank() == 0
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        parts = self._state(model, ema, optimizer, projector)
        dcp.save(parts, checkpoint_id=str(tmp / SHARDS))
        if main:
            save_file({f"rank{i}": s.contiguous() for i, s in enumerate(rng_states)}, str(tmp / "rng.safetensors"))
            sharded = dict(processes=self.world, format="torch.distributed.checkpoint", parts=sorted(parts))
            (tmp / STATE).write_text(json.dumps({**state, "sharded": sharded}, indent=2))
            if final.exists():
                shutil.rmtree(final)
            durable_replace(tmp, final)
            if keep_last > 0:
                for old in list_checkpoints(ckpt_dir)[:-keep_last]:
                    shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return final

    def restore(self, ckpt, model, ema, optimizer, projector=None) -> None:
        """Load a checkpoint into the sharded modules: a sharded one shard by shard (any
        process count: torch.distributed.checkpoint reshards), a single-file one from its
        full tensors (each process keeps its shard)."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        container = self._container(model, projector)
        if ckpt.sharded:
            from .checkpoint import load_error_cause

            state = self._state(model, ema, optimizer, projector)
            try:
                load_sharded(state, ckpt.path / SHARDS)
            except ShardIndexError as err:   # what a crafted index asks for, refused
                raise ckpt.error(f"{SHARDS}/.metadata", str(err)) from None
            except Exception as err:   # a truncated .metadata or .distcp, a refused pickle: one line (each rank)
                raise ckpt.error(SHARDS, load_error_cause(err)) from None
            for name, module in (("model", model), ("ema", ema), ("projector", projector)):
                if module is not None:
                    set_model_state_dict(module, state[name])
            set_optimizer_state_dict(container, optimizer, state["optimizer"])
            return
        full = StateDictOptions(full_state_dict=True)
        for name, module in (("model", model), ("ema", ema), ("projector", projector)):
            if module is not None:
                set_model_state_dict(module, ckpt.weights(name), options=full)
        name_of = {id(p): n for n, p in container.named_parameters()}
        names = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
        set_optimizer_state_dict(container, optimizer, by_name(ckpt.optimizer_state(), names), options=full)


def consolidate(path, out=None) -> Path:
    """Write the single-file checkpoint of a sharded one (``path``: the checkpoint, or a run
    folder for its latest) to ``out`` (default ``<run>/consolidated/``) as
    ``<out>/<step>/``: the usual model/EMA safetensors, ``optimizer.pt``, RNG and state, read
    on this one process. ``sample.py``, ``export.py``, ``evaluate_fid.py gen`` and a DDP
    ``--resume`` take it; an existing folder of that step is refused, never replaced."""
    from safetensors.torch import load_file

    from .checkpoint import open_checkpoint, save_checkpoint

    ckpt = open_checkpoint(path)
    if not ckpt.sharded:
        raise ValueError(f"{ckpt.path} is a single-file checkpoint already (model.safetensors, ema.safetensors, "
                         f"optimizer.pt): sample, export or resume from it as it is")
    root = Path(out) if out is not None else ckpt.path.parent.parent / "consolidated"
    if (root / ckpt.path.name).exists():
        raise FileExistsError(f"{root / ckpt.path.name} exists: move it aside, or pass another --out")
    state = {k: v for k, v in ckpt.state.items() if k != "sharded"}
    state["consolidated_from"] = str(ckpt.path)
    rng = load_file(str(ckpt.path / "rng.safetensors"))
    projector = ckpt.weights("projector") if ckpt.has_projector else None
    return save_checkpoint(root, model=ckpt.weights("model"), ema=ckpt.weights("ema"),
                           optimizer=ckpt.optimizer_state(), state=state,
                           rng_states=[rng[f"rank{i}"] for i in range(len(rng))], projector=projector,
                           after_failure=f"the sharded checkpoint {ckpt.path} is untouched: free space and rerun the "
                                         f"same command")


def resumable_gradient_sync(model) -> bool:
    """Make a DDP model's gradient all-reduce give the same sums after a resume as in an
    uninterrupted run (gloo, i.e. CPU processes; True when the hook was registered).

    DDP all-reduces gradients in buckets: one bucket in registration order on a model's
    first iteration, then buckets rebuilt in the order backward produced the gradients.
    A resumed run's first step therefore reduces with another bucket layout than the
    uninterrupted run's step there, and with 3 or more processes the ring's order of
    additions for an element follows its place in the bucket (2 processes only ever add
    a + b): 4 processes were 5e-6 to 1.3e-5 apart after 12 steps. This hook all-reduces
    each parameter's gradient on its own, so every element's sum depends only on the
    parameter, whatever the buckets. NCCL (GPUs) keeps DDP's own bucketed all-reduce:
    GPU runs are not bitwise anyway, and one collective per tensor would cost time there."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel) or \
            dist.get_backend(model.process_group) != "gloo":
        return False

    def per_tensor(group, bucket):
        buffer = bucket.buffer()
        buffer.div_(group.size())  # DDP's own hook: the mean over processes
        works = [dist.all_reduce(grad, group=group, async_op=True) for grad in bucket.gradients()]
        for work in works:
            work.wait()
        done = torch.futures.Future()
        done.set_result(buffer)
        return done

    model.register_comm_hook(model.process_group, per_tensor)
    return True
