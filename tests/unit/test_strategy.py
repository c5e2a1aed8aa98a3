"""HybridParallelStrategy: registration, argument validation, and the errors a user hits, each naming the fix.

The errors raised after the process group exists (precision, plans, heads) run in one 2-rank spawn; each case is
a ``fit`` that must fail with the expected message, and the spawn returns the messages.
"""

from __future__ import annotations

import copy
import functools
import gc
import pickle
import weakref

import lightning as L
import pytest
import torch
from torch import nn

from lightning_mm.callbacks import ReplicaSync
from lightning_mm.models import VLMModule
from lightning_mm.parallel.dims import ParallelDims
from lightning_mm.strategies import HybridParallelStrategy, pipeline_setup
from tests.helpers import random_samples, run_distributed, shard_batches


def test_registered_as_hybrid():
    trainer = L.Trainer(strategy="hybrid", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, HybridParallelStrategy)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tensor_parallel": 0}, "tensor_parallel must be an integer >= 1"),
        ({"data_parallel_replicate": 1.5}, "data_parallel_replicate must be an integer >= 1"),
        ({"data_parallel_shard": "most"}, "data_parallel_shard must be an integer >= 1 or 'auto'"),
        ({"sequence_parallel": True}, "sequence_parallel=True needs tensor_parallel > 1"),
        ({"tp_plan": ["q_proj"]}, "tp_plan must be a dict"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HybridParallelStrategy(**kwargs)


def test_degrees_that_do_not_divide_the_world_fail_before_any_process_group():
    loader = torch.utils.data.DataLoader(shard_batches(random_samples(4), 4, 0, 1), batch_size=None)
    trainer = L.Trainer(
        strategy=HybridParallelStrategy(tensor_parallel=2),
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        max_steps=1,
    )
    with pytest.raises(ValueError, match=r"world size 1 to be divisible by .*tensor_parallel"):
        trainer.fit(VLMModule(preset="tiny"), loader)
    assert not torch.distributed.is_initialized()


class _PlainUserModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    def training_step(self, batch, batch_idx):
        return self.net(batch).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.net(batch).pow(2).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _failing_fits(rank: int, world: int) -> dict[str, str]:
    vlm_batches = torch.utils.data.DataLoader(shard_batches(random_samples(4), 4, 0, 1), batch_size=None)
    user_batches = torch.utils.data.DataLoader([torch.randn(2, 4)], batch_size=None)
    cases = {
        "precision": (lambda: VLMModule(preset="tiny"), HybridParallelStrategy(), "16-true", vlm_batches),
        "no_plan": (_PlainUserModule, HybridParallelStrategy(tensor_parallel=2), "32-true", user_batches),
        "pattern": (
            _PlainUserModule,
            HybridParallelStrategy(tensor_parallel=2, tp_plan={"net.9": "colwise"}),
            "32-true",
            user_batches,
        ),
        "heads": (
            lambda: VLMModule(preset="tiny", model_overrides={"text_heads": 1}),
            HybridParallelStrategy(tensor_parallel=2),
            "32-true",
            vlm_batches,
        ),
    }
    # a module a first Trainer sharded (FSDP2 over both ranks), then given to a Trainer asking for another layout
    relaid = _PlainUserModule()
    _one_step_trainer(HybridParallelStrategy(), world, "32-true").fit(relaid, user_batches)
    cases["relaid"] = (lambda: relaid, HybridParallelStrategy(tensor_parallel=2), "32-true", user_batches)
    # trained by 2 replicas that ReplicaSync averages (not FSDP2): validated without it (fine), trained without it
    # (refused: nothing would average the replicas' gradients)
    replicas = _PlainUserModule()
    replicated = HybridParallelStrategy(data_parallel_replicate=2)
    _one_step_trainer(replicated, world, "32-true", [ReplicaSync(every=1)]).fit(replicas, user_batches)
    _one_step_trainer(HybridParallelStrategy(data_parallel_replicate=2), world, "32-true").validate(
        replicas, user_batches
    )
    cases["replicas"] = (lambda: replicas, HybridParallelStrategy(data_parallel_replicate=2), "32-true", user_batches)
    messages = {}
    for name, (make_module, strategy, precision, loader) in cases.items():
        try:
            _one_step_trainer(strategy, world, precision).fit(make_module(), loader)
            messages[name] = "no error"
        except ValueError as error:
            messages[name] = str(error)
    return messages


def _one_step_trainer(
    strategy: HybridParallelStrategy, world: int, precision: str, callbacks: list | None = None
) -> L.Trainer:
    return L.Trainer(
        strategy=strategy,
        callbacks=callbacks,
        accelerator="cpu",
        devices=world,
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=1,
    )


@functools.cache
def _messages() -> dict[str, str]:
    return run_distributed(_failing_fits, 2)[0]


@pytest.mark.parametrize(
    "case, expected",
    [
        ("precision", r"unsupported precision='16-true'.*supported values.*bf16-mixed"),
        ("no_plan", r"tensor_parallel=2 needs a plan.*tp_plan="),
        ("pattern", r"TP plan pattern 'net.9' matches nothing.*closest module names"),
        ("heads", r"tensor_parallel=2 must divide .*heads=1"),
        ("replicas", r"_PlainUserModule is already parallelized with .*'sync_replicas_every_step': \(False, True\)"),
        (
            "relaid",
            r"_PlainUserModule is already parallelized with .*'data_parallel_shard': \(2, 1\), 'tensor_parallel'",
        ),
    ],
)
def test_errors_name_the_fix(case, expected):
    assert _messages()[case] != "no error"
    assert __import__("re").search(expected, _messages()[case]), _messages()[case]


def test_a_pipelined_module_holds_its_runner_and_copies_hold_nothing():
    """The module owns its pipeline runner (a do-nothing forward pre-hook; the registry refers to it weakly): they
    are freed together, and a pickled or deep-copied module carries a hook that holds nothing."""

    class Runner:  # what the registry keeps of a PipelineRunner
        pass

    pp2 = {"pipeline_parallel": 2, "pipeline_schedule": "1F1B", "microbatches": 4}
    module, runner = torch.nn.Linear(2, 2), Runner()
    pipeline_setup.remember_parallelized(module, pp2, runner)
    assert pipeline_setup.parallelized(module, pp2) == (True, runner)
    with pytest.raises(ValueError, match=r"'microbatches': 4.*'microbatches': 8.*'microbatches': \(4, 8\)"):
        pipeline_setup.parallelized(module, {**pp2, "microbatches": 8})
    for copied in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        (hook,) = copied._forward_pre_hooks.values()
        assert hook.runner is None
        assert pipeline_setup.parallelized(copied, pp2) == (False, None)
    x = torch.ones(1, 2)
    assert torch.equal(module(x), torch.nn.functional.linear(x, module.weight, module.bias))  # the hook does nothing
    runner_ref = weakref.ref(runner)
    del runner
    gc.collect()
    assert runner_ref() is not None  # held by the module alone
    del module
    gc.collect()
    assert runner_ref() is None


def test_registry_of_parallelized_modules_without_a_pipeline_and_with_its_stages_gone():
    class Runner:
        pass

    def layout(**strategy_arguments) -> dict:  # what HybridParallelStrategy records, on 2 ranks
        strategy = HybridParallelStrategy(**strategy_arguments)
        dims = ParallelDims.from_args(2, **strategy.options.degrees)
        return pipeline_setup.layout(
            dims, strategy.options, strategy._microbatches(), strategy.sync_replicas_every_step
        )

    tp2, pp2 = layout(tensor_parallel=2), layout(pipeline_parallel=2, pipeline_split=["1"])
    plain, pipelined = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    assert pipeline_setup.parallelized(plain, tp2) == (False, None)
    pipeline_setup.remember_parallelized(plain, tp2, None)
    assert pipeline_setup.parallelized(plain, tp2) == (True, None)
    assert pipeline_setup.parallelized(plain, layout(tensor_parallel=2, microbatches=8)) == (True, None)  # no PP
    assert not plain._forward_pre_hooks  # nothing to hold
    # parallelized for one layout, given to a strategy with another: refused, naming what differs (a module
    # parallelized without a pipeline and then given pipeline_parallel=2 used to pass as done)
    for other, differing in (
        (pp2, r"'tensor_parallel': \(2, 1\), 'pipeline_parallel': \(1, 2\)\} "),
        (layout(), r"'data_parallel_shard': \(1, 2\), 'tensor_parallel': \(2, 1\)"),
        (layout(data_parallel_replicate=2), r"'data_parallel_replicate': \(1, 2\)"),
        (layout(tensor_parallel=2, sequence_parallel=True), r"'sequence_parallel': \(False, True\)"),
        (layout(tensor_parallel=2, tp_plan={"0": "colwise"}), r"'tp_plan': \(None, \{'0': 'colwise'\}\)"),
    ):
        with pytest.raises(ValueError, match=r"Linear is already parallelized with .*differing in \{" + differing):
            pipeline_setup.parallelized(plain, other)
    # style objects: equal when they are the same style (fresh objects), not equal when their layouts differ
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    from lightning_mm.parallel.plans import ReplicateParallel

    def styled(*styles) -> dict:
        return layout(tensor_parallel=2, tp_plan={f"{i}": style for i, style in enumerate(styles)})

    assert styled(ColwiseParallel(), ReplicateParallel()) == styled(ColwiseParallel(), ReplicateParallel())
    assert styled(ColwiseParallel()) != styled(ColwiseParallel(input_layouts=Shard(1)))
    # replicas synchronised by ReplicaSync (no gradient averaging each step): only training tells the layouts apart
    replicas = torch.nn.Linear(2, 2)
    pipeline_setup.remember_parallelized(
        replicas, layout(data_parallel_replicate=2, sync_replicas_every_step=False), None
    )
    with pytest.raises(ValueError, match=r"'sync_replicas_every_step': \(False, True\)"):
        pipeline_setup.parallelized(replicas, layout(data_parallel_replicate=2))
    assert pipeline_setup.parallelized(replicas, layout(data_parallel_replicate=2), fitting=False) == (True, None)
    pipeline_setup.remember_parallelized(pipelined, pp2, Runner())
    with pytest.raises(ValueError, match=r"'pipeline_parallel': \(2, 1\)"):
        pipeline_setup.parallelized(pipelined, layout())
    with pytest.raises(ValueError, match=r"'pipeline_split': \(\('1',\), \('0',\)\)"):
        pipeline_setup.parallelized(pipelined, layout(pipeline_parallel=2, pipeline_split=["0"]))
    pipelined._forward_pre_hooks.clear()  # the hook that held the stages, removed by hand
    gc.collect()
    with pytest.raises(RuntimeError, match="split into pipeline stages, and they are gone"):
        pipeline_setup.parallelized(pipelined, pp2)
