"""HybridParallelStrategy through ``Trainer.fit`` == one process, for every mesh of the parity matrix.

Each configuration trains the tiny reference VLM (captioning + contrastive + expert balance losses) for STEPS
AdamW steps with gradient clipping active, on the same global batches and seed as a plain one-process
``Trainer``. Ranks that share a data-parallel index (tp peers) get the same batch.

Both sides train in float64 (``DoublePrecision``), so what separates them is float64 rounding of another reduction
order: measured 2e-16 to 3e-14 relative in the losses and at most 2e-13 absolute in a parameter (tp2, fsdp2, tp2 with
sequence parallelism; reference on 2 threads, ranks on 1), on any machine. Hence losses within 1e-10 relative and
parameters within 1e-9 absolute: six orders of magnitude below one AdamW step (lr 3e-3), which a lost, doubled or mis-
scaled update or gradient would exceed. The old float32 version needed 1e-5 / 1e-3 and still failed on another machine
of this kind: AdamW turns last-bit differences of near-zero gradients into steps of up to lr.

Two configurations also train in float32, the dtype users train in; their tolerance is a noise floor measured
in the same test (:func:`tests.helpers.assert_float32_noise`): the float32 mesh run must be as close to the
float64 result as the float32 one-process run is, within FLOAT32_FACTOR.

To keep CI fast, one spawn per world size runs all of that world's configurations one after the other (each
``fit`` builds its own mesh on the already-initialised default group); every configuration is still its own
test. A user-written LightningModule (its own ``nn.Linear`` names, not the reference classes) trained with a
user ``tp_plan`` is checked the same way.
"""

from __future__ import annotations

import contextlib
import functools

import lightning as L
import pytest
import torch
import torchmetrics
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_mm.models import VLMModule
from lightning_mm.parallel.dims import ParallelDims
from lightning_mm.strategies import HybridParallelStrategy
from tests.helpers import (
    InitialWeights,
    LossRecorder,
    assert_float32_noise,
    full_copy,
    quiet_trainer,
    random_samples,
    relative_error,
    run_distributed,
    shard_batches,
)

GLOBAL_BATCH, STEPS, SEED, CLIP = 8, 5, 1234, 0.5
LOSS_RTOL, PARAM_ATOL = 1e-10, 1e-9  # float64 runs; see the module docstring
FLOAT32_CONFIGS = ("fsdp2", "tp2_sequence_parallel")
FLOAT32_FACTOR, FLOAT32_PARAMS_FACTOR, FLOAT32_PARAM_FACTOR = 10.0, 30.0, 100.0
"""float32 runs: the distance from the float64 result is at most this many times the float32 one-process run's
distance from it: over the losses of all steps; over all parameters together; each parameter alone. Parameter
norms are dominated by a few elements whose gradient is near zero, where AdamW turns rounding into steps of up to
lr: a heavy-tailed ratio, hence the larger factors. Measured here with 1 and 2 threads (printed by the test):
losses 0.4-1.0, all parameters 0.5-4.0, worst single parameter 1.5-6.2 (embed_tokens, tp2 with sequence
parallelism). A lost or doubled update moves a parameter by its whole update, 1e2-1e5 times the floor."""

# name -> (world size, strategy arguments)
CONFIGS: dict[str, tuple[int, dict]] = {
    "fsdp2": (2, {}),
    "hsdp2x1": (2, {"data_parallel_replicate": 2, "data_parallel_shard": 1}),
    "hsdp1x2": (2, {"data_parallel_replicate": 1, "data_parallel_shard": 2}),
    "tp2": (2, {"tensor_parallel": 2}),
    "tp2_sequence_parallel": (2, {"tensor_parallel": 2, "sequence_parallel": True}),
    "fsdp2_activation_checkpointing": (2, {"activation_checkpointing": True}),
    "fsdp2_selective_activation_checkpointing": (2, {"activation_checkpointing": "selective"}),
    "fsdp2_compiled": (2, {"compile": True}),  # each block through torch.compile (inductor), eager around them
    "fsdp2xtp2": (4, {"tensor_parallel": 2}),
    "fsdp2xtp2_sequence_parallel_activation_checkpointing": (
        4,
        {"tensor_parallel": 2, "sequence_parallel": True, "activation_checkpointing": True},
    ),
    "hsdp2x2": (4, {"data_parallel_replicate": 2, "data_parallel_shard": 2}),
}


META_CONFIGS = ("fsdp2", "fsdp2xtp2")
"""Also run with the module built on the meta device (``trainer.init_module(empty_init=True)``)."""


ACCUMULATE = 2
ACCUMULATE_CONFIGS = ("hsdp2x1", "fsdp2")
"""These also train with ``accumulate_grad_batches=ACCUMULATE`` against a one-process run that accumulates: HSDP
all-reduces each micro-batch's gradients across replica groups, FSDP2 reduce-scatters them into the shards each
micro-batch (the shards then add up)."""


def _trainer(world: int, strategy, callbacks, precision: str = "64-true", accumulate: int = 1) -> L.Trainer:
    return quiet_trainer(
        world,
        strategy,
        STEPS,
        callbacks,
        precision=precision,
        gradient_clip_val=CLIP,
        accumulate_grad_batches=accumulate,
    )


def _fit_reference_vlm(
    rank: int, world: int, kwargs: dict | None, precision: str = "64-true", meta: bool = False, accumulate: int = 1
) -> dict:
    """``kwargs=None``: the one-process reference (plain Trainer); else HybridParallelStrategy(**kwargs); ``meta``:
    the module is built inside ``trainer.init_module(empty_init=True)`` (on the meta device, initialised shard by
    shard after parallelisation); ``accumulate``: micro-batches per optimizer step (``STEPS`` steps either way)."""
    L.seed_everything(SEED, verbose=False)
    # compile=True: a block that dynamo gives up on (too many recompilations) would run eagerly and pass unnoticed
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    if kwargs is None:
        strategy, dp_rank, dp_size = "auto", 0, 1
    else:
        dims = ParallelDims.from_args(world, **{k: v for k, v in kwargs.items() if k.startswith(("data", "tensor"))})
        strategy, dp_rank, dp_size = HybridParallelStrategy(**kwargs), dims.data_parallel_rank(rank), dims.dp
    samples = random_samples(GLOBAL_BATCH * STEPS * accumulate, seed=7)
    batches = shard_batches(samples, GLOBAL_BATCH, dp_rank, dp_size)
    recorder, initial = LossRecorder(), InitialWeights()
    trainer = _trainer(world if kwargs is not None else 1, strategy, [recorder, initial], precision, accumulate)
    with trainer.init_module(empty_init=True) if meta else contextlib.nullcontext():
        module = VLMModule(preset="tiny", warmup_steps=1, learning_rate=3e-3)
    assert all(param.is_meta for param in module.parameters()) == meta
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    params = {name: full_copy(param) for name, param in module.model.named_parameters()}
    updates = {name: params[name] - initial.weights[name].to(params[name].dtype) for name in params}
    layout = {name: type(param).__name__ for name, param in module.model.named_parameters()}
    # The module's torchmetrics states start from zero after a reset, also when the model was built on meta (a
    # to_empty of the whole module replaced their defaults by uninitialised memory).
    reset_states = []
    for metric in (m for m in module.modules() if isinstance(m, torchmetrics.Metric)):
        metric.reset()
        reset_states += [v for v in metric.metric_state.values() if isinstance(v, torch.Tensor)]
    return {
        "losses": recorder.losses,
        "params": params,
        "updates": updates,
        "layout": layout,
        "initial": initial.weights,
        "metrics_reset_to_zero": len(reset_states) > 0 and all(bool((v == 0).all()) for v in reset_states),
    }


def _run_configs(rank: int, world: int, names: list[str]) -> dict:
    results = {name: _fit_reference_vlm(rank, world, dict(CONFIGS[name][1])) for name in names}
    for name in META_CONFIGS:
        if name in names:
            results[f"{name}/meta"] = _fit_reference_vlm(rank, world, dict(CONFIGS[name][1]), meta=True)
    for name in FLOAT32_CONFIGS:
        if name in names:
            results[f"{name}/float32"] = _fit_reference_vlm(rank, world, dict(CONFIGS[name][1]), "32-true")
    for name in ACCUMULATE_CONFIGS:
        if name in names:
            kwargs = dict(CONFIGS[name][1])
            results[f"{name}/accumulate{ACCUMULATE}"] = _fit_reference_vlm(rank, world, kwargs, accumulate=ACCUMULATE)
    return results


@functools.cache
def _reference(precision: str = "64-true", accumulate: int = 1) -> dict:
    return _fit_reference_vlm(0, 1, None, precision, accumulate=accumulate)


@functools.cache
def _parallel_results(world: int) -> dict:
    names = [name for name, (size, _) in CONFIGS.items() if size == world]
    return run_distributed(_run_configs, world, names, timeout=400)[0]


# Time: the first configuration of each world size pays for its cached launch, the later ones take ~0 s: fsdp2 for the
# 2-rank one (13 fits) and the in-process reference, fsdp2xtp2 for the 4-rank one (3 fits of 5 float64 steps on 4 ranks
# sharing 2 cores). One launch per world size is already the minimum; 5 steps give AdamW and clipping several updates.
@pytest.mark.parametrize("name", list(CONFIGS) + [f"{name}/meta" for name in META_CONFIGS])
def test_hybrid_strategy_matches_one_process(name):
    """A mesh run equals one process; ``NAME/meta``: also when the module was built on the meta device and each rank
    initialised only its shards (the initial weights equal the one-process build's exactly)."""
    reference = _reference()
    result = _parallel_results(CONFIGS[name.removesuffix("/meta")][0])[name]
    assert result["metrics_reset_to_zero"] and reference["metrics_reset_to_zero"]
    if name.endswith("/meta"):
        for param_name, expected in reference["initial"].items():
            torch.testing.assert_close(result["initial"][param_name], expected, rtol=0, atol=0, msg=param_name)
    _assert_matches(result, reference)


@pytest.mark.parametrize("name", ACCUMULATE_CONFIGS)
def test_gradient_accumulation_matches_one_process(name):
    """``accumulate_grad_batches=2`` on 2 replica groups (HSDP) and on 2 FSDP2 shards equals one process
    accumulating the same micro-batches."""
    result = _parallel_results(2)[f"{name}/accumulate{ACCUMULATE}"]
    _assert_matches(result, _reference(accumulate=ACCUMULATE), micro_batches=ACCUMULATE)


def _assert_matches(result: dict, reference: dict, micro_batches: int = 1) -> None:
    """Losses (one per micro-batch) within LOSS_RTOL, every parameter within PARAM_ATOL and its update within 1e-8
    relative (in norm) of the one-process run's."""
    assert len(reference["losses"]) == STEPS * micro_batches
    assert reference["losses"][0] != reference["losses"][-1]  # the reference trains
    torch.testing.assert_close(
        torch.tensor(result["losses"], dtype=torch.float64),
        torch.tensor(reference["losses"], dtype=torch.float64),
        rtol=LOSS_RTOL,
        atol=0,
    )
    assert set(result["params"]) == set(reference["params"])
    for param_name, expected in reference["params"].items():
        actual = result["params"][param_name]
        assert actual.dtype == expected.dtype == torch.float64, (param_name, actual.dtype, expected.dtype)
        torch.testing.assert_close(actual, expected, rtol=0, atol=PARAM_ATOL, msg=lambda m, n=param_name: f"{n}: {m}")
        # Every parameter really trained, and by the same update (relative in norm).
        assert relative_error(result["updates"][param_name], reference["updates"][param_name]) < 1e-8, param_name


@pytest.mark.parametrize("name", FLOAT32_CONFIGS)
def test_float32_strategy_within_noise_floor(name):
    """float32, the dtype users train in: the mesh run is as accurate as the one-process run (see FLOAT32_FACTOR);
    the ratios are printed (``pytest -s``)."""
    exact, reference = _reference(), _reference("32-true")
    result = _parallel_results(CONFIGS[name][0])[f"{name}/float32"]
    assert result["params"]["embed_tokens.weight"].dtype == torch.float32

    def losses(run: dict) -> torch.Tensor:
        return torch.tensor(run["losses"], dtype=torch.float64)

    def flat(run: dict) -> torch.Tensor:
        return torch.cat([run["params"][n].double().flatten() for n in exact["params"]])

    ratios = {
        "losses": assert_float32_noise(losses(result), losses(reference), losses(exact), FLOAT32_FACTOR, "losses"),
        "parameters": assert_float32_noise(
            flat(result), flat(reference), flat(exact), FLOAT32_PARAMS_FACTOR, "parameters"
        ),
    }
    for param_name, expected in exact["params"].items():
        actual, single = result["params"][param_name], reference["params"][param_name]
        ratios[param_name] = assert_float32_noise(actual, single, expected, FLOAT32_PARAM_FACTOR, param_name)
    worst = max((n for n in ratios if n not in ("losses", "parameters")), key=ratios.get)
    print(
        f"\n{name} float32 noise ratios: losses {ratios['losses']:.2f}, parameters {ratios['parameters']:.2f}, "
        f"worst parameter {ratios[worst]:.2f} ({worst})"
    )


def test_parallel_configs_really_shard():
    """Guards against a strategy that silently falls back to replication: the meshes shard what they claim."""
    two = _parallel_results(2)
    fsdp_layout = two["fsdp2"]["layout"]
    plain = sorted(name for name, kind in fsdp_layout.items() if kind != "DTensor")
    assert plain == ["logit_scale"]  # FSDP2 shards every parameter except the 0-d one it cannot shard
    assert two["tp2"]["layout"]["vision.blocks.0.attn.q_proj.weight"] == "DTensor"
    # tp alone leaves the embeddings (not in the plan) as plain tensors
    assert two["tp2"]["layout"]["embed_tokens.weight"] != "DTensor"


# ----------------------------------------------------------------------------------------- user model


class UserRegressor(L.LightningModule):
    """An ordinary user model: its own Linear names, an MLP, a head; MSE on random regression data."""

    def __init__(self) -> None:
        super().__init__()
        self.build()

    def build(self) -> None:
        self.encoder = nn.ModuleDict({"up": nn.Linear(12, 32), "down": nn.Linear(32, 12)})
        self.norm = nn.LayerNorm(12)
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x + self.encoder["down"](torch.nn.functional.gelu(self.encoder["up"](x)))
        return self.head(self.norm(hidden))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class LateUserRegressor(UserRegressor):
    """The same model with its layers built in ``configure_model``, Lightning's place for deferred construction: the
    strategy parallelises it after the hook exactly as if ``__init__`` had built them."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)

    def configure_model(self) -> None:
        if not hasattr(self, "head"):  # (called again by a second fit)
            self.build()


USER_PLAN = {"encoder.up": "colwise", "encoder.down": "rowwise"}


def _user_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 12, generator=gen), torch.randn(8, 3, generator=gen)) for _ in range(STEPS)]


def _fit_user(rank: int, world: int, kwargs: dict | None, late: bool = False) -> dict:
    """float64 (``DoublePrecision`` converts the module and the batches), as the reference VLM above; ``late``: the
    layers are built in ``configure_model``."""
    L.seed_everything(SEED, verbose=False)
    module = LateUserRegressor() if late else UserRegressor()
    strategy = "auto" if kwargs is None else HybridParallelStrategy(**kwargs)
    recorder = LossRecorder()
    trainer = _trainer(1 if kwargs is None else world, strategy, [recorder])
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(_user_batches(), batch_size=None))
    params = {name: full_copy(param) for name, param in module.named_parameters()}
    return {
        "losses": recorder.losses,
        "params": params,
        "up_is_dtensor": isinstance(module.encoder["up"].weight, DTensor),
    }


@pytest.mark.parametrize("late", [False, True], ids=["built_in_init", "built_in_configure_model"])
def test_user_model_with_user_tp_plan_matches_one_process(late):
    reference = _fit_user(0, 1, None, late)
    result = run_distributed(_fit_user, 2, {"tensor_parallel": 2, "tp_plan": USER_PLAN}, late)[0]
    assert result["up_is_dtensor"]
    torch.testing.assert_close(
        torch.tensor(result["losses"], dtype=torch.float64),
        torch.tensor(reference["losses"], dtype=torch.float64),
        rtol=LOSS_RTOL,
        atol=0,
    )
    for name, expected in reference["params"].items():
        assert expected.dtype == torch.float64, name
        torch.testing.assert_close(result["params"][name], expected, rtol=0, atol=PARAM_ATOL, msg=name)
