"""Codecs of lightning_mm.parallel.compression without a process group: error bounds, Top-k, error feedback,
NaN / Inf handling, wire format and byte accounting; CompressedAllToAll argument checks."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_mm.callbacks.compression import CompressedAllToAll
from lightning_mm.parallel.compression import (
    CodecConfig,
    CommStats,
    Encoded,
    ErrorFeedback,
    Mode,
    block_rotation,
    code_count,
    decode,
    dequantize_blocks,
    encode,
    index_dtype_for,
    quantize_blocks,
    topk_indices,
)


def _varied(numel: int, seed: int = 0) -> torch.Tensor:
    """Values whose magnitude spans 9 decades, so blocks have very different scales."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=gen) * 10 ** (torch.rand(numel, generator=gen) * 9 - 6)


def _per_element_scale(scales: torch.Tensor, block_size: int, numel: int) -> torch.Tensor:
    return scales.float().repeat_interleave(block_size)[:numel]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("block_size", [1, 32, 100])
def test_block_quantization_error_is_at_most_half_a_scale(bits, scale_dtype, block_size):
    numel = 1000  # not a multiple of 32 or 100: the last block is short
    x = _varied(numel, seed=bits + block_size)
    dtype = CodecConfig(scale_dtype=scale_dtype).scale_torch_dtype
    codes, scales = quantize_blocks(x, bits, block_size, dtype)
    qmax = 2 ** (bits - 1) - 1
    assert scales.dtype == dtype and scales.shape == (math.ceil(numel / block_size),)
    assert codes.shape == (((numel + 1) // 2,) if bits == 4 else (numel,))
    decoded = dequantize_blocks(codes, scales, numel, bits, block_size)
    scale = _per_element_scale(scales, block_size, numel)
    error = (x - decoded).abs()
    # fp32 rounding of code * scale adds at most an ulp or two of the value.
    assert (error <= scale / 2 + 2e-7 * x.abs()).all(), (error / scale).max()
    # Scales are never below max|x| / qmax (nothing clipped) and, for bf16, at most one bf16 step above it.
    absmax = torch.nn.functional.pad(x.abs(), (0, scales.numel() * block_size - numel)).view(-1, block_size).amax(1)
    assert (scales.float() >= absmax / qmax).all()
    assert (scales.float() <= absmax / qmax * (1 + 2**-7) + 1e-45).all()


def test_zero_blocks_decode_to_exact_zeros():
    x = torch.zeros(300)
    x[200:] = torch.linspace(-1, 1, 100)
    codes, scales = quantize_blocks(x, 8, 100)
    assert scales[:2].tolist() == [0.0, 0.0]
    decoded = dequantize_blocks(codes, scales, 300, 8, 100)
    assert torch.equal(decoded[:200], torch.zeros(200)) and not decoded.isnan().any()


def test_topk_keeps_exactly_the_k_largest_magnitudes():
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    k = 50
    kept = topk_indices(x, k)
    assert kept.shape == (k,) and torch.equal(kept, kept.sort().values)
    expected = torch.argsort(x.abs(), descending=True)[:k]
    assert set(kept.tolist()) == set(expected.tolist())
    dropped = torch.ones(5000, dtype=torch.bool)
    dropped[kept] = False
    assert x[kept].abs().min() > x[dropped].abs().max()
    with pytest.raises(ValueError, match="k must be"):
        topk_indices(x, 0)


def test_topk_encode_sends_the_k_largest_within_the_int8_bound():
    x = torch.randn(20_000, generator=torch.Generator().manual_seed(2))
    config = CodecConfig(topk_ratio=0.01, block_size=64)
    encoded = encode(x, config)
    assert encoded.mode == Mode.SPARSE and encoded.count == 200
    assert encoded.indices.dtype == torch.int16  # 20 000 < 2**15
    decoded = decode(encoded)
    sent = decoded != 0
    assert set(sent.nonzero().squeeze(1).tolist()) == set(torch.argsort(x.abs(), descending=True)[:200].tolist())
    scale = _per_element_scale(encoded.scales, 64, 200)
    assert ((decoded[encoded.indices.long()] - x[encoded.indices.long()]).abs() <= scale / 2 + 1e-7).all()


@pytest.mark.parametrize(
    ("numel", "dtype"), [(256, torch.uint8), (257, torch.int16), (32768, torch.int16), (32769, torch.int32)]
)
def test_indices_use_the_smallest_dtype_and_reach_the_last_element(numel, dtype):
    assert index_dtype_for(numel) == dtype
    x = torch.zeros(numel)
    x[-1], x[0] = 5.0, -3.0  # the largest magnitude sits at the last index (255, 32767, ...)
    encoded = encode(x, CodecConfig(topk_ratio=1 / numel))
    assert encoded.mode == Mode.SPARSE and encoded.indices.dtype == dtype
    assert encoded.indices.long().tolist() == [numel - 1]
    assert decode(Encoded.from_bytes(encoded.to_bytes()))[-1].item() == pytest.approx(5.0, rel=1e-6)


def test_error_feedback_running_sum_of_sent_values_converges_to_the_inputs():
    numel, steps = 4096, 300
    config = CodecConfig(topk_ratio=0.01, block_size=32)
    gen = torch.Generator().manual_seed(3)
    mean = torch.randn(numel, generator=gen) * 0.2  # a drift every step, as gradients have
    feedback = ErrorFeedback()
    inputs_sum, sent_sum, sent_sum_no_feedback = torch.zeros(numel), torch.zeros(numel), torch.zeros(numel)
    residual_norms, relative_gaps = [], []
    for _ in range(steps):
        x = mean + torch.randn(numel, generator=gen)
        compensated = feedback.compensate("w", x)
        sent = decode(encode(compensated, config))
        feedback.update("w", compensated, sent)
        inputs_sum += x
        sent_sum += sent
        sent_sum_no_feedback += decode(encode(x, config))
        residual_norms.append(feedback.residual("w", (numel,)).norm().item())
        relative_gaps.append(((inputs_sum - sent_sum).norm() / inputs_sum.norm()).item())
    # The identity behind error feedback: what is missing from the sent sum is exactly the current residual.
    torch.testing.assert_close(inputs_sum - sent_sum, feedback.residual("w", (numel,)), rtol=0, atol=1e-3)
    # The residual stays bounded (does not grow with the step count) while the sums grow linearly...
    assert max(residual_norms[steps // 2 :]) < 1.5 * max(residual_norms[: steps // 2])
    # ...so the sent sum converges to the input sum (the gap shrinks like 1 / steps: 0.62 at step 30, 0.125 at
    # step 300 when written); without feedback most of the signal is lost for good (gap 0.92).
    assert relative_gaps[-1] < 0.5 * relative_gaps[steps // 10] and relative_gaps[-1] < 0.2
    no_feedback_gap = ((inputs_sum - sent_sum_no_feedback).norm() / inputs_sum.norm()).item()
    assert no_feedback_gap > 0.8


NON_FINITE_CONFIGS = (
    CodecConfig(),
    CodecConfig(topk_ratio=0.01),
    CodecConfig(bits=4, scale_dtype="bfloat16"),
    CodecConfig(bits=4, scale_dtype="bfloat16", rotation=True),
    CodecConfig(bits=8, rotation=True),
)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), "inf and -inf"])
@pytest.mark.parametrize("position", [0, 2071, 4195])
def test_non_finite_inputs_are_sent_raw_never_quantized(bad, position):
    # Every codec, wherever the value sits (first, inner and the short last block). Dense payloads find a NaN /
    # Inf through their block scales: the vectorised maximum of a block with a NaN is a NaN whose bits the bf16
    # round-up would carry into a finite -0.0 (this size takes that path); +Inf and -Inf in one block rotate to NaN.
    x = torch.randn(4196)
    if bad == "inf and -inf":
        x[position], x[position - 1] = float("inf"), float("-inf")  # (position 0: the other is the last element)
    else:
        x[position] = bad
    for config in NON_FINITE_CONFIGS:
        assert encode(x, config).reason == "nonfinite", config
    for config in (CodecConfig(), CodecConfig(topk_ratio=0.01)):
        encoded = encode(x, config)
        assert encoded.mode == Mode.RAW and encoded.reason == "nonfinite"
        round_trip = decode(Encoded.from_bytes(encoded.to_bytes()))
        torch.testing.assert_close(round_trip, x, rtol=0, atol=0, equal_nan=True)
    # Raw payloads travel in the collective's dtype (here bf16) ...
    assert encode(x, CodecConfig(), raw_dtype=torch.bfloat16).values.dtype == torch.bfloat16
    # ... and a residual never picks up the NaN / Inf: the other entries keep their (zero) error.
    feedback = ErrorFeedback()
    compensated = feedback.compensate("g", x)
    feedback.update("g", compensated, decode(encode(compensated, CodecConfig())))
    assert torch.equal(feedback.residual("g", x.shape), torch.zeros(x.shape))


def test_tensors_under_min_numel_are_sent_raw_and_exact():
    x = torch.randn(100)
    encoded = encode(x, CodecConfig(min_numel=101))
    assert encoded.mode == Mode.RAW and encoded.reason == "small"
    assert torch.equal(decode(encoded), x)
    assert encode(x, CodecConfig(min_numel=100)).mode == Mode.DENSE


@pytest.mark.parametrize(
    "config",
    [
        CodecConfig(),
        CodecConfig(bits=4, block_size=7),
        CodecConfig(topk_ratio=0.1),
        CodecConfig(topk_ratio=0.1, bits=4, scale_dtype="bfloat16"),
    ],
)
def test_wire_format_round_trips_and_nbytes_is_the_wire_length(config):
    x = _varied(3001, seed=4)
    encoded = encode(x, config)
    wire = encoded.to_bytes()
    assert wire.dtype == torch.uint8 and wire.numel() == encoded.nbytes and encoded.nbytes % 8 == 0
    assert torch.equal(decode(Encoded.from_bytes(wire)), decode(encoded))


def test_top1_percent_int8_is_at_least_40x_smaller_than_fp32_indices_included():
    # 4 MiB of fp32 gradient (a mid-sized layer; DDP's default bucket is 25 MiB).
    numel = 2**20
    x = torch.randn(numel, generator=torch.Generator().manual_seed(5))
    encoded = encode(x, CodecConfig(topk_ratio=0.01, bits=8))
    k = math.ceil(0.01 * numel)
    assert encoded.mode == Mode.SPARSE and encoded.indices.dtype == torch.int32  # 2**20 > 2**15
    # Honest count: 4-byte index + 1-byte value per kept element, a 4-byte scale per 128, header and padding.
    assert encoded.nbytes >= k * (4 + 1) + math.ceil(k / 128) * 4 + 16
    assert encoded.nbytes == encoded.to_bytes().numel()
    ratio_fp32 = numel * 4 / encoded.nbytes
    assert ratio_fp32 >= 40, ratio_fp32
    assert numel * 2 / encoded.nbytes >= 20  # against bf16
    dense = encode(x, CodecConfig(bits=8))
    assert 3.8 < numel * 4 / dense.nbytes < 4.0  # INT8 + fp32 scales per 128: a bit under 4x


def test_comm_stats_break_even_bandwidth():
    stats = CommStats(bytes_before=1000, bytes_after=100, encode_seconds=0.5, decode_seconds=0.4)
    assert stats.ratio == pytest.approx(10.0)
    # B* = S (1 - 1/r) / T_c = 1000 * 0.9 / 0.9 s
    assert stats.break_even_bytes_per_second == pytest.approx(1000.0)
    assert CommStats(bytes_before=100, bytes_after=100, encode_seconds=1.0).break_even_bytes_per_second == 0.0
    stats.reset()
    assert stats.bytes_before == 0 and stats.ratio == 1.0


def test_error_feedback_state_round_trip_and_shape_change():
    feedback = ErrorFeedback()
    feedback.residual("a", (3,)).add_(torch.tensor([1.0, 2.0, 3.0]))
    restored = ErrorFeedback()
    restored.load_state_dict(feedback.state_dict())
    assert torch.equal(restored.residual("a", (3,)), torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(restored.residual("a", (4,)), torch.zeros(4)) and restored.resets == ["a"]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"bits": 2}, "bits"),
        ({"block_size": 0}, "block_size"),
        ({"topk_ratio": 0.0}, "topk_ratio"),
        ({"topk_ratio": 1.5}, "topk_ratio"),
        ({"scale_dtype": "float16"}, "scale_dtype"),
        ({"min_numel": -1}, "min_numel"),
    ],
)
def test_codec_config_errors_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        CodecConfig(**kwargs)
    with pytest.raises(ValueError, match=name):
        CompressedAllToAll(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"targets": ("grad", "activations")}, "targets"),
        ({"targets": ()}, "targets"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"sparsity_warmup_steps": -1}, "sparsity_warmup_steps"),
        ({"sparsity_warmup_steps": 2.5}, "sparsity_warmup_steps"),
        ({"sparsity_warmup_steps": 10, "topk_ratio": 1.0}, "sparsity_warmup_steps"),
        ({"sparsity_warmup_steps": 10, "targets": ("moe",)}, "sparsity_warmup_steps"),
    ],
)
def test_callback_errors_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        CompressedAllToAll(**kwargs)


def test_moe_target_fails_at_setup_without_expert_parallelism():
    callback = CompressedAllToAll(targets=("moe", "grad"))
    with pytest.raises(ValueError, match="expert_parallel > 1"):
        callback.setup(None, None, "fit")
    CompressedAllToAll(targets="grad").setup(None, None, "fit")  # a plain string is one target


def _fake_trainer(model: nn.Module, data_parallel_size: int) -> SimpleNamespace:
    strategy = SimpleNamespace(model=model, data_parallel_size=data_parallel_size)
    return SimpleNamespace(strategy=strategy, world_size=data_parallel_size)


def test_defaults_are_the_adam_safe_codec():
    """``CompressedAllToAll()`` is T1 (dense INT4, rotated blocks, bf16 scales, error feedback), which AdamW accepts;
    unset codec arguments elsewhere keep INT8 / float32 / no rotation."""
    default = CompressedAllToAll()
    assert (default.config.topk_ratio, default.config.bits, default.config.rotation) == (1.0, 4, True)
    assert default.config.scale_dtype == "bfloat16" and default.error_feedback
    topk = CompressedAllToAll(topk_ratio=0.01, allow_topk_with_adaptive_optimizer=True)
    assert (topk.config.bits, topk.config.rotation, topk.config.scale_dtype) == (8, False, "float32")
    moe = CompressedAllToAll(targets=("moe",))
    assert (moe.config.bits, moe.config.rotation, moe.config.scale_dtype) == (8, False, "float32")
    int8 = CompressedAllToAll(bits=8)
    assert (int8.config.bits, int8.config.rotation, int8.config.scale_dtype) == (8, False, "float32")
    odd_blocks = CompressedAllToAll(block_size=100)  # rotation needs power-of-two blocks: the plain INT8 codec
    assert (odd_blocks.config.bits, odd_blocks.config.rotation) == (8, False)


def test_callback_without_a_data_parallel_sync_warns_and_does_nothing():
    model = nn.Linear(2, 2)
    callback = CompressedAllToAll()
    with pytest.warns(UserWarning, match="no data-parallel gradient sync"):
        callback.on_fit_start(_fake_trainer(model, 1), model)
    assert callback.registered is None


def test_callback_rejects_a_strategy_it_cannot_hook_into():
    model = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="DDP .*or FSDP2"):
        CompressedAllToAll().on_fit_start(_fake_trainer(model, 2), model)


def test_sparsity_warmup_decays_geometrically_to_topk_ratio():
    callback = CompressedAllToAll(topk_ratio=0.01, warmup_steps=3, sparsity_warmup_steps=100)
    assert [callback.topk_ratio_at(step) for step in range(3)] == [None, None, None]  # uncompressed warm-up
    ramp = [callback.topk_ratio_at(step) for step in range(3, 103)]
    assert ramp[0] == pytest.approx(0.01**0.01) and ramp[49] == pytest.approx(0.1)
    assert all(later < earlier for earlier, later in zip(ramp, ramp[1:], strict=False))
    # Equal ratios between consecutive steps (geometric), and the last ramp step lands exactly on topk_ratio.
    assert ramp[50] / ramp[49] == pytest.approx(ramp[1] / ramp[0]) and ramp[-1] == pytest.approx(0.01)
    assert callback.topk_ratio_at(103) == callback.topk_ratio_at(10_000) == 0.01
    assert CompressedAllToAll(topk_ratio=0.01, warmup_steps=2).topk_ratio_at(2) == 0.01  # no ramp: straight to it


def test_sparsity_warmup_sets_the_codec_of_each_step():
    callback = CompressedAllToAll(topk_ratio=0.01, warmup_steps=1, sparsity_warmup_steps=4)
    seen = []
    for step in range(7):
        callback.on_train_batch_start(SimpleNamespace(global_step=step), None, None, step)
        logged = callback.metrics()["compression/topk_ratio"]
        seen.append((callback.state.active, callback.state.config.topk_ratio, logged))
    assert seen[0] == (False, 0.01, 1.0)  # warm-up: uncompressed, logged as ratio 1
    expected = [0.01**0.25, 0.01**0.5, 0.01**0.75, 0.01, 0.01, 0.01]
    for (active, ratio, logged), want in zip(seen[1:], expected, strict=True):
        assert active and ratio == pytest.approx(want) and logged == ratio
    assert callback.config.topk_ratio == 0.01  # the configured target itself is never changed


@pytest.mark.parametrize(
    ("optimizer", "topk_ratio", "refused"),
    [
        (torch.optim.AdamW, 0.01, True),
        (torch.optim.Adam, 0.1, True),
        (torch.optim.SGD, 0.01, False),
        (torch.optim.AdamW, 1.0, False),
    ],
)
def test_top_k_with_an_adaptive_optimizer_is_refused_unless_allowed(optimizer, topk_ratio, refused, recwarn):
    model = nn.Linear(2, 2)
    trainer = SimpleNamespace(optimizers=[optimizer(model.parameters(), lr=0.1)])
    if refused:
        with pytest.raises(ValueError, match="allow_topk_with_adaptive_optimizer=True") as error:
            CompressedAllToAll(topk_ratio=topk_ratio)._check_adaptive_topk(trainer)
        assert optimizer.__name__ in str(error.value) and "+150 %" in str(error.value)
    else:
        CompressedAllToAll(topk_ratio=topk_ratio)._check_adaptive_topk(trainer)
    # Allowed: it runs, with the same message as a warning.
    CompressedAllToAll(topk_ratio=topk_ratio, allow_topk_with_adaptive_optimizer=True)._check_adaptive_topk(trainer)
    messages = [str(w.message) for w in recwarn if "adaptive optimizers" in str(w.message)]
    assert bool(messages) == refused, messages


# ------------------------------------------------------------------------------------ Hadamard rotation (T1)


@pytest.mark.parametrize("block_size", [1, 2, 64, 128])
def test_block_rotation_is_orthogonal_fixed_and_not_a_plain_hadamard(block_size):
    rotation = block_rotation(block_size)
    assert rotation.shape == (block_size, block_size)
    torch.testing.assert_close(rotation @ rotation.T, torch.eye(block_size), atol=1e-6, rtol=0)
    assert torch.equal(rotation, block_rotation(block_size))  # the same on every call (and every rank)
    assert torch.allclose(rotation.abs(), torch.full_like(rotation, block_size**-0.5))
    if block_size >= 64:  # random signs: the first column is not all positive, as in Sylvester's matrix
        assert (rotation[:, 0] < 0).any() and (rotation[:, 0] > 0).any()
    with pytest.raises(ValueError, match="power of two"):
        block_rotation(block_size * 3 if block_size > 1 else 3)


@pytest.mark.parametrize("block_size", [1, 2, 8, 32, 128, 256])
def test_factored_rotation_equals_the_dense_matrix_across_chunks(block_size):
    """The codec rotates with two small Kronecker factors, chunk by chunk; the result is the dense matrix's, on
    inputs spanning several chunks and a partial last one."""
    from lightning_mm.parallel.compression.codecs import _ROTATION_CHUNK_ELEMENTS, _factored_rotation

    blocks = torch.randn((2 * _ROTATION_CHUNK_ELEMENTS + 3 * block_size) // block_size, block_size)
    rotation = _factored_rotation(block_size, blocks.device)
    dense = block_rotation(block_size)
    torch.testing.assert_close(rotation.rotate(blocks), blocks @ dense, rtol=0, atol=1e-5)
    torch.testing.assert_close(rotation.unrotate(blocks), blocks @ dense.T, rtol=0, atol=1e-5)
    torch.testing.assert_close(rotation.unrotate(rotation.rotate(blocks)), blocks, rtol=0, atol=1e-5)


@pytest.mark.parametrize("inverse", [False, True])
def test_rotation_in_place_equals_a_new_tensor(inverse):
    """The codec rotates each chunk into its own buffer (``out`` the input itself); as out of place."""
    from lightning_mm.parallel.compression.codecs import _ROTATION_CHUNK_ELEMENTS, _factored_rotation

    rotation = _factored_rotation(128, torch.device("cpu"))
    apply = rotation.unrotate if inverse else rotation.rotate
    blocks = torch.randn((_ROTATION_CHUNK_ELEMENTS + 5 * 128) // 128, 128)
    expected = apply(blocks)
    assert apply(blocks, out=blocks) is blocks
    assert torch.equal(blocks, expected)


@pytest.mark.parametrize(
    "bits_, block_size, rotate",
    [(8, 128, False), (4, 128, True), (4, 100, False), (8, 33, False), (4, 33, False), (4, 64, True)],
)
def test_codec_results_do_not_depend_on_the_chunking(monkeypatch, bits_, block_size, rotate):
    """On CPU the codec quantizes and dequantizes chunk by chunk (cache-sized, codecs._CHUNK_ELEMENTS, and the
    rotation in smaller chunks inside); chunks of a few blocks (odd counts of codes, a short last block and all-zero
    blocks included) give the same bits of codes, scales and values as one chunk over the whole tensor."""
    from lightning_mm.parallel.compression import codecs

    def bits(t: torch.Tensor) -> torch.Tensor:  # (so that -0.0 differs from +0.0)
        return t.view(torch.int16 if t.element_size() == 2 else torch.int32) if t.is_floating_point() else t

    numel = 3 * 1024 + 77
    x = torch.randn(numel, generator=torch.Generator().manual_seed(3)) * torch.logspace(-6, 0, numel)
    x[block_size : 4 * block_size] = 0  # all-zero blocks: a scale of 0
    monkeypatch.setattr(codecs, "_CHUNK_ELEMENTS", 1 << 30)
    monkeypatch.setattr(codecs, "_ROTATION_CHUNK_ELEMENTS", 1 << 30)
    codes, scales = quantize_blocks(x, bits_, block_size, torch.bfloat16, rotate)
    values = dequantize_blocks(codes, scales, numel, bits_, block_size, rotate)
    assert (scales == 0).any()
    for chunk in (1, 3 * block_size, 1000):
        monkeypatch.setattr(codecs, "_CHUNK_ELEMENTS", chunk)
        monkeypatch.setattr(codecs, "_ROTATION_CHUNK_ELEMENTS", max(1, chunk // 3))
        chunked_codes, chunked_scales = quantize_blocks(x, bits_, block_size, torch.bfloat16, rotate)
        assert torch.equal(bits(chunked_codes), bits(codes)) and torch.equal(bits(chunked_scales), bits(scales)), chunk
        decoded = dequantize_blocks(codes, scales, numel, bits_, block_size, rotate)
        assert torch.equal(bits(decoded), bits(values)), chunk


def test_codec_takes_tensors_that_require_grad():
    """``encode`` of a parameter itself (not its gradient) works, builds no graph and gives the bytes of its values."""
    weight = torch.nn.Linear(64, 64).weight
    for config in (CodecConfig(), CodecConfig(bits=4, rotation=True), CodecConfig(topk_ratio=0.1)):
        wire = encode(weight, config).to_bytes()
        assert torch.equal(wire, encode(weight.detach(), config).to_bytes())
        assert not decode(Encoded.from_bytes(wire)).requires_grad


@pytest.mark.parametrize("count", [1, 2, 7, 4096, 4097])
def test_nibble_packing_round_trips_every_code(count):
    from lightning_mm.parallel.compression.codecs import _pack_nibbles, _unpack_nibbles

    codes = torch.randint(-8, 8, (count,), dtype=torch.int8)
    codes[: min(count, 16)] = torch.arange(-8, 8, dtype=torch.int8)[: min(count, 16)]  # every value, if room
    packed = _pack_nibbles(codes.view(torch.uint8).add(8))
    assert packed.dtype == torch.uint8 and packed.shape == ((count + 1) // 2,)
    # Element 2i in the low nibble, 2i + 1 in the high one (the wire format).
    assert int(packed[0]) & 0x0F == int(codes[0]) + 8
    assert torch.equal(_unpack_nibbles(packed, count), codes)


@pytest.mark.parametrize("rotate", [False, True])
def test_quantization_leaves_its_input_untouched(rotate):
    x = torch.randn(3 * 128, generator=torch.Generator().manual_seed(5))  # whole blocks: unrotated, a view of x
    kept = x.clone()
    codes, scales = quantize_blocks(x, 4, 128, rotate=rotate)
    assert torch.equal(x, kept)
    decoded = dequantize_blocks(codes, scales, x.numel(), 4, 128, rotate=rotate)
    # |error| <= scale / 2 per coordinate where it was quantized; rotated back, a coordinate's error is bounded by
    # the block's error norm, sqrt(128) * scale / 2 (typically far less)
    bound = scales.float().repeat_interleave(128) / 2 * (128**0.5 if rotate else 1.0)
    assert ((decoded - x).abs() <= bound * (1 + 1e-6)).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_rotated_quantization_error_is_half_a_scale_in_the_rotated_basis(bits):
    numel, block = 1000, 64  # the last block is short: zero-padded, sent whole
    x = _varied(numel, seed=3)
    codes, scales = quantize_blocks(x, bits, block, rotate=True)
    sent = code_count(numel, block, True)
    assert sent == 1024
    assert codes.shape == ((sent // 2,) if bits == 4 else (sent,))
    decoded = dequantize_blocks(codes, scales, numel, bits, block, rotate=True)
    padded = torch.nn.functional.pad(x, (0, sent - numel)).view(-1, block)
    rotated_error = (padded - torch.nn.functional.pad(decoded, (0, sent - numel)).view(-1, block)) @ block_rotation(
        block
    )
    # The rotation is orthogonal: the error, rotated, is the per-coordinate rounding error (<= scale / 2) ...
    assert (rotated_error.abs() <= scales[:, None] / 2 * (1 + 1e-5) + 1e-9).all()
    # ... and the L2 error equals the rotated one.
    torch.testing.assert_close((x - decoded).norm(), rotated_error.norm(), rtol=1e-4, atol=1e-9)


def test_rotation_halves_the_4_bit_error_of_heavy_tailed_values():
    generator = torch.Generator().manual_seed(0)
    heavy = torch.distributions.StudentT(3.0).sample((1 << 15,))  # the tails of real gradient blocks, exaggerated
    spiky = torch.randn(1 << 15, generator=generator)
    spiky[::128] = 10.0  # one outlier per block: every other element's scale is 10x too coarse
    gaussian = torch.randn(1 << 15, generator=generator)

    def error(x: torch.Tensor, rotation: bool) -> float:
        return float((decode(encode(x, CodecConfig(bits=4, rotation=rotation))) - x).norm() / x.norm())

    for x in (heavy, spiky):
        assert error(x, True) < 0.6 * error(x, False)
    # Gaussian blocks have no outliers to spread: the same error either way (rotation only costs time there).
    assert abs(error(gaussian, True) - error(gaussian, False)) < 0.01


@pytest.mark.parametrize("topk_ratio", [1.0, 0.05])
def test_rotated_payloads_round_trip_through_the_wire_format(topk_ratio):
    x = _varied(5000, seed=4)
    config = CodecConfig(bits=4, block_size=128, topk_ratio=topk_ratio, rotation=True, scale_dtype="bfloat16")
    encoded = encode(x, config)
    assert encoded.rotated and encoded.mode == (Mode.DENSE if topk_ratio == 1.0 else Mode.SPARSE)
    wire = encoded.to_bytes()
    assert wire.numel() == encoded.nbytes
    parsed = Encoded.from_bytes(wire)
    assert parsed.rotated and parsed.count == encoded.count
    assert torch.equal(decode(parsed), decode(encoded))
    # The header tells the decoder: without the flag the same codes decode to something else.
    unrotated = Encoded(**{**parsed.__dict__, "rotated": False})
    assert not torch.equal(decode(unrotated), decode(parsed))


def test_rotation_needs_a_power_of_two_block():
    with pytest.raises(ValueError, match="power of two"):
        CodecConfig(bits=4, block_size=100, rotation=True)
    with pytest.raises(ValueError, match="power of two"):
        CompressedAllToAll(bits=4, block_size=96, rotation=True)


def test_auto_trial_runs_abba_times_whole_steps_and_skips_interrupted_intervals():
    from lightning_mm.parallel.compression import AutoTrial

    times = [0.0]
    trial = AutoTrial(steps=4, warmup=2, margin=0.05, clock=lambda: times[-1])
    modes = []
    for step in range(5, 15):
        for _ in range(2):  # gradient accumulation: the step's time is spread over its two micro-batches
            compressed = trial.begin_step(step, torch.device("cpu"))
            times.append(times[-1] + (0.6 if compressed else 1.0) / 2)
        modes.append(compressed)
        if step == 10:
            trial.interrupt()
            times.append(times[-1] + 100.0)
    # 5 plain, 6 compressed, untimed (each side's first use); then 7 plain, 8 and 9 compressed, 10 plain (its
    # interval interrupted: not counted), 11 plain: 2 + 2 samples at step 12's start, which decides (compressed on).
    assert modes == [False, True, False, True, True, False, False, True, True, True]
    assert trial.decision is True
    # whole steps (both micro-batches), not the last micro-batch's share
    assert trial.measured == {"plain_seconds": pytest.approx(1.0), "compressed_seconds": pytest.approx(0.6)}
    assert trial.begin_step(50, torch.device("cpu")) is True


@pytest.mark.parametrize(("compressed_seconds", "chosen"), [(0.96, False), (0.94, True)])
def test_auto_trial_compresses_only_when_clearly_faster(compressed_seconds, chosen):
    from lightning_mm.parallel.compression import AutoTrial

    times = [0.0]
    trial = AutoTrial(steps=4, warmup=1, margin=0.05, clock=lambda: times[-1])
    step = 0
    while trial.decision is None:
        times.append(times[-1] + (compressed_seconds if trial.begin_step(step, torch.device("cpu")) else 1.0))
        step += 1
    assert trial.decision is chosen


def test_auto_trial_stays_plain_when_every_interval_is_interrupted_and_checks_its_arguments():
    from lightning_mm.parallel.compression import AutoTrial

    trial = AutoTrial(steps=4, warmup=2, clock=lambda: 0.0)
    modes = []
    for step in range(40):
        modes.append(trial.begin_step(step, torch.device("cpu")))
        trial.interrupt()  # validation every step
    assert trial.decision is False and trial.measured == {}
    assert modes[-1] is False and any(modes)  # it did try, then settled on plain after 2 + 4 * 4 steps
    for bad in ({"steps": 3}, {"steps": 0}, {"warmup": -1}, {"margin": 1.0}):
        with pytest.raises(ValueError):
            AutoTrial(**bad)


def test_auto_is_refused_for_the_moe_exchange():
    with pytest.raises(ValueError, match="auto=True"):
        CompressedAllToAll(auto=True, targets=("moe",))
    with pytest.raises(ValueError, match="auto must be a bool"):
        CompressedAllToAll(auto="yes")


def test_a_thread_that_first_ran_the_codec_under_inference_mode_runs_it_outside_too():
    # The codec's per-thread scratch buffers are made on first use; made under inference_mode they would be
    # inference tensors, which cannot be written outside it.
    import threading

    x, config = torch.randn(5000), CodecConfig(bits=4, scale_dtype="bfloat16", rotation=True)
    expected = decode(encode(x, config))
    results: dict[str, torch.Tensor | BaseException] = {}

    def run() -> None:
        try:
            with torch.inference_mode():
                results["inside"] = decode(encode(x, config)).clone()
            results["outside"] = decode(encode(x, config))
        except BaseException as error:  # (reported below, not lost in the thread)
            results["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert "error" not in results, results.get("error")
    assert torch.equal(results["inside"], expected) and torch.equal(results["outside"], expected)


def test_top_k_sends_raw_a_float64_value_beyond_float32s_range():
    # Its sum is finite in float64, but its block scale (float32) is not: raw, never an Inf scale that decodes to NaN.
    x = torch.randn(4096, dtype=torch.float64)
    x[5] = 1e39
    for config in (CodecConfig(topk_ratio=0.01), CodecConfig()):
        encoded = encode(x, config)
        assert encoded.reason == "nonfinite", config
        assert torch.equal(decode(Encoded.from_bytes(encoded.to_bytes())), x.float())


def test_error_feedback_in_a_non_float32_residual_gives_the_same_bytes():
    # A residual of another dtype (e.g. one handed to compressed_all_to_all) takes the path through temporaries.
    from lightning_mm.parallel.compression import CommStats
    from lightning_mm.parallel.compression.collectives import _encode_segment

    config = CodecConfig(bits=4, scale_dtype="bfloat16", rotation=True)
    segment = torch.randn(3000)
    start = torch.randn(3000) * 1e-2
    fp32, fp64 = start.clone(), start.double()
    wire32 = _encode_segment(segment, fp32, config, torch.float32, CommStats())
    wire64 = _encode_segment(segment, fp64, config, torch.float32, CommStats())
    assert torch.equal(wire32, wire64)
    torch.testing.assert_close(fp64.float(), fp32, rtol=0, atol=1e-6)
