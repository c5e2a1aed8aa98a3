"""The ``lightning-mm make-shards`` subcommand: writes the synthetic dataset of
:mod:`lightning_mm.datamodules.synthetic` anywhere, from the command line.

:func:`make_shards_main` parses the arguments (options left out take the preset's values), checks that the output
directory can be written, and reports every error as one ``lightning-mm make-shards: error: ...`` line on stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning_mm.datamodules.synthetic import (
    DATASET_VERSION,
    SYNTHETIC_PRESETS,
    _check_existing,
    _normalized,
    _preset_dir,
    _validate_generator_args,
    default_cache_dir,
    make_shards,
)

__all__ = ["make_shards_main"]

_PROG = "lightning-mm make-shards"


class _CliError(Exception):
    """A usage error: reported as one line on stderr with exit code 2."""


class _OneLineParser(argparse.ArgumentParser):
    """ArgumentParser whose errors raise instead of printing the usage block and exiting."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise _CliError(message)


def _option_name(param: str) -> str:
    """Yield the CLI spelling of a parameter name (``num_train`` -> ``--num-train``)."""
    return "--" + param.replace("_", "-")


def _build_parser() -> argparse.ArgumentParser:
    """Yield the argument parser of ``lightning-mm make-shards``."""
    parser = _OneLineParser(
        prog=_PROG,
        description=(
            "Generate the deterministic synthetic image-caption dataset (WebDataset tar shards of "
            "coloured shapes with true English captions, a byte-level BPE tokenizer.json and a "
            "manifest.json). Options left out take the preset's values."
        ),
    )
    presets = sorted(SYNTHETIC_PRESETS)
    parser.add_argument(
        "--output-dir",
        default=None,
        help="directory to write the dataset to (default: the preset's cache dir "
        "CACHE/synthetic-<preset>-v1, where CACHE is $LIGHTNING_MM_CACHE or "
        "~/.cache/lightning_mm; CACHE/synthetic-<preset>-custom-<hash>-v1 when other "
        "options change the preset's values, so the preset's cache stays pristine)",
    )
    parser.add_argument(
        "--preset",
        default="default",
        choices=presets,
        help=f"parameter preset, one of {', '.join(presets)} (default: default)",
    )
    parser.add_argument("--num-train", type=int, default=None, help="number of training samples")
    parser.add_argument("--num-val", type=int, default=None, help="number of validation samples")
    parser.add_argument("--samples-per-shard", type=int, default=None, help="samples per tar shard")
    parser.add_argument(
        "--seed", type=int, default=None, help="integer seed; the same seed gives identical images and captions"
    )
    parser.add_argument("--min-short-side", type=int, default=None, help="smallest short image side in pixels (>= 8)")
    parser.add_argument("--max-short-side", type=int, default=None, help="largest short image side in pixels")
    parser.add_argument(
        "--vocab-size", type=int, default=None, help="BPE tokenizer vocabulary size, special tokens included (>= 300)"
    )
    parser.add_argument(
        "--png-fraction", type=float, default=None, help="fraction of images stored as PNG instead of JPEG, in [0, 1]"
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="regenerate a dataset made with other parameters (the directory is replaced; refused while it holds "
        "files the dataset does not list)",
    )
    return parser


def _check_writable(out: Path) -> None:
    """Raise ``OSError`` unless a dataset can be created at ``out``.

    Creates the parent directories and probes them with a throw-away directory, because
    permission bits alone do not tell (root ignores them; read-only mounts do not show).
    """
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} exists and is not a directory")
    # mkdir(parents=True) reports a regular file on the way as a confusing "File exists".
    for ancestor in out.parents:
        if ancestor.exists():
            if not ancestor.is_dir():
                raise NotADirectoryError(f"{ancestor} is not a directory")
            break
    out.parent.mkdir(parents=True, exist_ok=True)
    probe = tempfile.mkdtemp(prefix=f".{out.name}.probe-", dir=out.parent)
    os.rmdir(probe)


def _describe_oserror(exc: OSError) -> str:
    """Yield a short message for ``exc``: its reason and the path it is about."""
    if exc.strerror and exc.filename:
        return f"{exc.strerror}: {exc.filename}"
    return str(exc)


def _one_line(text: object) -> str:
    """Yield ``text`` squeezed to a single line."""
    return " ".join(str(text).split())


def make_shards_main(argv: list[str] | None = None) -> int:
    """Run ``lightning-mm make-shards``; yield the exit code (0 ok, 2 bad arguments, 1 failure).

    Errors are printed as a single ``lightning-mm make-shards: error: ...`` line on stderr.
    """

    def fail(message: object, code: int = 2) -> int:
        print(f"{_PROG}: error: {_one_line(message)}", file=sys.stderr)
        return code

    try:
        args = _build_parser().parse_args(argv)
    except _CliError as exc:
        return fail(exc)

    preset = SYNTHETIC_PRESETS[args.preset]
    params = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in preset.items()}
    try:
        _validate_generator_args(params, display=_option_name)
    except ValueError as exc:
        return fail(exc)

    if args.output_dir is not None:
        out = Path(args.output_dir).expanduser().absolute()
    else:
        out = _preset_dir(default_cache_dir(), args.preset).absolute()
        if params != preset:
            # Never store non-preset data under the preset's name: ensure_synthetic_shards
            # would later hand it out as the preset.
            digest = hashlib.sha1(json.dumps(params, sort_keys=True).encode()).hexdigest()[:10]
            out = out.with_name(f"synthetic-{args.preset}-custom-{digest}-v{DATASET_VERSION}")

    try:
        _check_writable(out)
    except OSError as exc:
        return fail(f"--output-dir {out} cannot be created or written: {_describe_oserror(exc)}")
    try:
        existing = _check_existing(out, _normalized(params), args.force)
    except FileExistsError as exc:
        return fail(str(exc).replace("overwrite=True (--force)", "--force"))
    except OSError as exc:
        return fail(f"--output-dir {out}: {_describe_oserror(exc)}")
    if existing is not None:
        print(
            f"{_PROG}: {out} already holds this dataset "
            f"({params['num_train']} train + {params['num_val']} val samples); "
            "nothing to do (pass --force to regenerate)"
        )
        return 0

    start = time.perf_counter()
    try:
        manifest_path = make_shards(out, **params, overwrite=args.force)
    except (ValueError, FileExistsError) as exc:
        return fail(exc)
    except OSError as exc:
        return fail(f"writing {out} failed: {_describe_oserror(exc)}", code=1)
    seconds = time.perf_counter() - start
    with manifest_path.open(encoding="utf-8") as f:
        splits = json.load(f)["splits"]
    print(
        f"{_PROG}: wrote {splits['train']['num_samples']} train + {splits['val']['num_samples']} val "
        f"samples ({len(splits['train']['shards'])} + {len(splits['val']['shards'])} shards) "
        f"to {out} in {seconds:.1f} s"
    )
    return 0
