"""``lightning-mm plan``: the command line (arguments, the ranked table, the JSON report)."""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lightning_mm.planning.estimates import MAX_DEVICES, Candidate, plan
from lightning_mm.planning.hardware import GIB, Hardware
from lightning_mm.planning.hf_shape import CausalLMShape
from lightning_mm.planning.mesh import AXES
from lightning_mm.planning.shapes import ModelShape
from lightning_mm.planning.vlm_shape import VLMShape
from lightning_mm.planning.workload import Workload
from lightning_mm.validation import require_int


def _gib(value: float) -> str:
    return f"{value / GIB:.2f}"


_AC_LABELS = {False: "off", True: "on", "selective": "sel"}


def format_table(candidates: Sequence[Candidate], hardware: Hardware, top: int | None = None) -> str:
    """The ranked candidates as text: memory in GiB (MiB when every peak is under 1 GiB), times in ms, bytes in GB."""
    rows = list(candidates)[:top] if top else list(candidates)
    small = bool(rows) and max(c.peak_bytes for c in rows) < GIB
    unit, scale = ("MiB", 2**20) if small else ("GiB", GIB)
    header = (
        f"{'#':>3} {'mesh':34} {'AC':3} {'fits':4} {'peak ' + unit:>9} {'state':>7} {'act':>7} {'other':>7} "
        f"{'load':>7} {'step ms':>9} {'compute':>9} {'comm':>9} {'bubble':>9} {'intra GB':>9} {'inter GB':>9}  "
        "axes (GB/step)"
    )
    lines = [header, "-" * len(header)]
    for i, c in enumerate(rows, 1):
        m = c.memory
        state = m["params"] + m["grads"] + m["optimizer"]
        other = c.peak_bytes - state - m["activations"]
        axes = ", ".join(
            f"{axis} {c.comm_bytes[axis] / 1e9:.3g}{'*' if c.links[axis] == 'inter' else ''}"
            for axis in AXES
            if c.comm_bytes[axis] > 0
        )
        mesh = c.mesh.label + (f" m{c.microbatches}" if c.mesh.pp > 1 else "")
        t = {k: f"{c.time[k] * 1e3:.3g}" for k in ("step", "compute", "exposed_comm", "bubble")}
        lines.append(
            f"{i:>3} {mesh:34} {_AC_LABELS[c.activation_checkpointing]:3} {'yes' if c.fits else 'NO':4} "
            f"{c.peak_bytes / scale:9.2f} {state / scale:7.2f} {m['activations'] / scale:7.2f} {other / scale:7.2f} "
            f"{m['load'] / scale:7.2f} "
            f"{t['step']:>9} {t['compute']:>9} {t['exposed_comm']:>9} {t['bubble']:>9} "
            f"{c.comm_bytes['intra'] / 1e9:9.3g} {c.comm_bytes['inter'] / 1e9:9.3g}  {axes or '-'}"
        )
    budget = hardware.memory_bytes * hardware.usable_memory_fraction
    lines.append(
        f"fits: peak <= {hardware.usable_memory_fraction:.0%} of {_gib(hardware.memory_bytes)} GiB = {_gib(budget)} GiB"
        "; state = parameters + gradients + AdamW states; act = saved activations (all microbatches in flight); "
        "other = the rest at the peak (batch, unsharded FSDP parameters and gradients, loss and pipeline buffers, "
        "recomputation); load = the peak while a pretrained checkpoint is read into this rank's shards (its fp32 "
        "shards + one read chunk; loading the whole model on every rank would hold all of it); comm = exposed "
        "communication; * = inter-node axis; tpN+sp = tensor_parallel=N, sequence_parallel=True"
    )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ command line

_EPILOG = """assumptions (the docstring of lightning_mm/planning/__init__.py has the details):
  memory    live tensor bytes per rank: fp32 master weights, fp32 gradients and AdamW moments, sharded as the
            strategy shards them (tp, ep, FSDP2 with padding); the batch; FSDP2's unsharded root, and in a block's
            backward that block, the prefetched one and its unsharded gradients (whole stages under pp);
            activations = what autograd saves, per layer from the model's structure (1F1B: min(pp - s, m)
            microbatches on stage s; AC keeps block inputs and recomputes one block; selective AC also keeps
            attention outputs and every second matmul output); pipeline buffers; peak = max
            over end of forward, each block's backward and the optimizer step. One sample per row, no padding;
            bf16-mixed = FSDP2 bf16 parameters (autocast without FSDP). Leave headroom for the allocator.
  traffic   bytes a rank sends per optimizer step, averaged over ranks, ring formulas: all-gather and
            reduce-scatter (n-1)/n, all-reduce 2(n-1)/n, all-to-all the off-rank share, sends their payload.
  time      compute = FLOPs (x3 for forward+backward, x4 with AC, x3 + the recomputed matmul share with selective
            AC) / (peak x MFU); FSDP/HSDP traffic overlaps
            compute (only the excess, at least one unit's share, is exposed); tp / ep / pp traffic fully exposed;
            bubble = (pp-1)/(m+pp-1) of compute. An axis uses the intra-node link when its groups fit in a node.
            No latency term: small messages look cheaper than they are.

examples:
  lightning-mm plan --preset small --devices 8 --memory-gb 80 --devices-per-node 8 --tokens 1024 --patches 1024
  lightning-mm plan --hf-config path/to/config.json --devices 16 --devices-per-node 8 --json plan.json
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-mm plan",
        description="Rank device meshes (pp x dp_replicate x dp_shard x tp, ep) for a model by estimated per-rank "
        "peak memory and step time.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=("tiny", "small", "1b"), help="a reference VLM preset")
    source.add_argument("--hf-config", help="an HF Llama-style config.json (or its directory)")
    parser.add_argument("--devices", type=int, required=True, help=f"number of devices (ranks), at most {MAX_DEVICES}")
    parser.add_argument("--memory-gb", type=float, default=80.0, help="memory per device in GiB (default 80)")
    parser.add_argument("--devices-per-node", type=int, default=None, help="devices per node (default: one node)")
    parser.add_argument(
        "--intra-gbps", type=float, default=2400.0, help="intra-node bandwidth per device, Gbit/s (default 2400)"
    )
    parser.add_argument(
        "--inter-gbps", type=float, default=200.0, help="inter-node bandwidth per device, Gbit/s (default 200)"
    )
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense peak TFLOP/s per device (989)")
    parser.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation (0.4)")
    parser.add_argument("--usable-memory", type=float, default=0.9, help="fraction of the memory a plan may fill (0.9)")
    parser.add_argument("--tokens", type=int, default=None, help="text tokens per sample (sequence length)")
    parser.add_argument("--patches", type=int, default=None, help="image patches per sample (reference VLM)")
    parser.add_argument("--micro-batch", type=int, default=1, help="samples per forward per data-parallel rank (1)")
    parser.add_argument(
        "--global-batch", type=int, default=None, help="samples per optimizer step (default: micro batch x devices)"
    )
    parser.add_argument("--precision", choices=("bf16-mixed", "32-true"), default="bf16-mixed")
    parser.add_argument(
        "--activation-checkpointing",
        choices=("both", "on", "off", "selective", "all"),
        default="both",
        help="evaluate every mesh with full AC, without, or both (default); selective AC alone, or all three",
    )
    parser.add_argument("--top", type=int, default=20, help="rows to print (0: all)")
    parser.add_argument("--show-refused", action="store_true", help="list refused meshes with the reasons")
    parser.add_argument("--json", dest="json_out", default=None, help="write every candidate and refusal here")
    return parser


_COUNTS = {  # option dest: (minimum, maximum) of the integer; an option not given (None) keeps its default
    "devices": (1, MAX_DEVICES),
    "devices_per_node": (1, None),
    "tokens": (1, None),
    "patches": (0, None),
    "micro_batch": (1, None),
    "global_batch": (1, None),
    "top": (0, None),
}
_NUMBERS = {  # option dest: the factor to the unit the estimates use (the product must stay finite too)
    "memory_gb": GIB,
    "intra_gbps": 1e9 / 8,
    "inter_gbps": 1e9 / 8,
    "peak_tflops": 1e12,
}
_FRACTIONS = ("mfu", "usable_memory")


def _option(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a value the plan cannot use with ``parser.error`` (one line naming the option, exit 2), before the
    model is built: argparse's ``type=int`` / ``float`` take ``0``, ``-4``, ``nan`` and ``inf``, which would
    otherwise end in a traceback deep in the estimates or, worse, in a plan of NaNs."""
    for dest, (minimum, maximum) in _COUNTS.items():
        if getattr(args, dest) is None:  # not given: the default
            continue
        try:
            hint = "the planner's limit" if maximum else ""
            require_int(_option(dest), getattr(args, dest), minimum, maximum, hint=hint)
        except ValueError as error:
            parser.error(str(error))
    # math.isfinite: NaN fails no "<= 0" test, and a NaN memory marks every mesh "NO" with exit 0
    for dest, scale in _NUMBERS.items():
        value = getattr(args, dest)
        if not (math.isfinite(value) and value > 0 and math.isfinite(value * scale)):
            parser.error(f"{_option(dest)} must be a finite number > 0, got {value}")
    for dest in _FRACTIONS:
        value = getattr(args, dest)
        if not (math.isfinite(value) and 0 < value <= 1):
            parser.error(f"{_option(dest)} must be in (0, 1], got {value}")
    per_node = args.devices_per_node
    if per_node and args.devices > per_node and args.devices % per_node:
        parser.error(f"--devices {args.devices} is not a multiple of --devices-per-node {per_node} (whole nodes)")
    if args.json_out:
        _check_output(parser, Path(args.json_out))


def _check_output(parser: argparse.ArgumentParser, path: Path) -> None:
    """Refuse a ``--json`` path that cannot be written before planning, not after it (what a permission check
    cannot see, e.g. a file under /proc, fails at the write and is reported there)."""
    if path.is_dir():
        parser.error(f"--json {path} is a directory; name the file to write")
    existing = next(parent for parent in path.parents if parent.exists())  # "." or "/" at the latest
    if not existing.is_dir():
        parser.error(f"--json {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        parser.error(f"--json {path}: cannot create files in {existing} (permission denied)")


def _reason(error: ValueError | OSError) -> str:
    """An error's message without the ``[Errno 2]`` of an OSError's."""
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror}: {error.filename}" if error.filename else error.strerror
    return str(error)


def model_from_args(args: argparse.Namespace) -> tuple[ModelShape, int, int]:
    """The model and default tokens / patches per sample for the parsed arguments."""
    if args.preset:
        model: ModelShape = VLMShape(args.preset)
        config = model.config  # type: ignore[attr-defined]
        return (
            model,
            64 if args.preset == "tiny" else 128 if args.preset == "small" else 1024,
            config.max_patches_per_image,
        )
    model = CausalLMShape(args.hf_config)
    return model, model.cfg.get("max_position_embeddings") or 2048, 0  # type: ignore[attr-defined]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    try:
        model, tokens, patches = model_from_args(args)
    except (ValueError, OSError) as error:
        if not args.hf_config:
            raise  # a preset that does not build is a bug, not the user's input
        parser.error(f"--hf-config {args.hf_config}: {_reason(error)}")
    try:
        return _plan_and_report(args, model, tokens, patches)
    except (ValueError, OSError) as error:  # the last line: what check_args cannot know (e.g. too many meshes)
        parser.error(_reason(error))


def _plan_and_report(args: argparse.Namespace, model: ModelShape, tokens: int, patches: int) -> int:
    workload = Workload(
        tokens=args.tokens if args.tokens is not None else tokens,
        patches=(args.patches if args.patches is not None else patches) if model.kind == "reference-vlm" else 0,
        micro_batch=args.micro_batch,
        global_batch=args.global_batch,
        precision=args.precision,
    )
    hardware = Hardware(
        devices=args.devices,
        memory_bytes=args.memory_gb * GIB,
        devices_per_node=args.devices_per_node,
        intra_node_bytes_per_s=args.intra_gbps * 1e9 / 8,
        inter_node_bytes_per_s=args.inter_gbps * 1e9 / 8,
        peak_flops=args.peak_tflops * 1e12,
        mfu=args.mfu,
        usable_memory_fraction=args.usable_memory,
    )
    ac = {
        "both": (False, True),
        "on": (True,),
        "off": (False,),
        "selective": ("selective",),
        "all": (False, "selective", True),
    }[args.activation_checkpointing]
    candidates, refused = plan(model, workload, hardware, ac)
    info = model.describe()
    print(
        f"{info['name']}: {info['parameters'] / 1e6:.1f} M parameters, {info['pipeline_units']} pipeline units; "
        f"{workload.tokens} tokens + {workload.patches} patches per sample, micro batch {workload.micro_batch}, "
        f"global batch {workload.global_batch or workload.micro_batch * hardware.devices}, {workload.precision}; "
        f"{hardware.devices} devices ({hardware.ranks_per_node} per node), {args.memory_gb:g} GiB each"
    )
    print(format_table(candidates, hardware, args.top or None))
    print(f"{len(candidates)} candidates ({len(candidates) // len(ac)} meshes), {len(refused)} meshes refused")
    if args.show_refused:
        for mesh, reasons in refused:
            print(f"  refused {mesh.label}: {'; '.join(reasons)}")
    if args.json_out:
        out = {
            "model": info,
            "workload": asdict(workload),
            "hardware": asdict(hardware),
            "candidates": [c.as_dict() for c in candidates],
            "refused": [{"mesh": {**asdict(m), "label": m.label}, "reasons": r} for m, r in refused],
        }
        try:
            # allow_nan=False: NaN and Infinity are not JSON (other readers refuse them), and after check_args no
            # estimate should be one
            text = json.dumps(out, indent=2, default=_json_default, allow_nan=False)
        except ValueError as error:
            raise ValueError(f"--json {args.json_out}: an estimate is not a finite number ({error})") from None
        path = Path(args.json_out)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        except OSError as error:
            raise OSError(error.errno, f"--json {path}: cannot write it ({_reason(error)})") from None
        print(f"wrote {args.json_out}")
    return 0


def _json_default(value: Any) -> Any:
    if isinstance(value, set):
        return sorted(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
