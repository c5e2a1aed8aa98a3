"""``lightning-mm export-hf`` on checkpoints it cannot export: a damaged file, hyper-parameters of the wrong types,
no weights, an OUT that cannot be created. Each is one line naming the file and what is wrong (exit 2), never a
traceback, and leaves no OUT (nor its staging directory) behind. Tiny one-file checkpoints, no model trained."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
import torch

from lightning_mm import checkpoint as ckpt
from lightning_mm.models.hf import export_pretrained
from lightning_mm.models.hf.export import export_main
from tests.hf_models import LLAMA


def _export_cli(capsys, checkpoint: Path, output: Path) -> str:
    """``lightning-mm export-hf``'s one-line error (exit 2, no traceback); nothing written beside OUT."""
    with pytest.raises(SystemExit) as exited:
        export_main([str(checkpoint), str(output)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("lightning-mm export-hf: error: "), err
    assert not output.exists() and not output.with_name(f".{output.name}.partial").exists()
    return err


def _flat_zip() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("meta.pt", b"x")
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"hello world\n", "(KeyError: 101)"),
        (b"", "(the file is empty)"),
        (_flat_zip(), "file in archive is not in a subdirectory"),
    ],
    ids=["text", "empty", "flat-zip"],
)
def test_a_damaged_file_is_one_line_naming_it(tmp_path, capsys, content, reason):
    (tmp_path / "text.txt").write_bytes(content)
    err = _export_cli(capsys, tmp_path / "text.txt", tmp_path / "out")
    assert f"{tmp_path / 'text.txt'} is corrupt or truncated and cannot be read" in err and reason in err, err


def _llama_state(embed: torch.Tensor) -> dict[str, torch.Tensor]:
    from lightning_mm.models.hf import HFCausalLMModule

    with torch.device("meta"):
        state = HFCausalLMModule(config=LLAMA).state_dict()
    return {key: embed if key.endswith("embed_tokens.weight") else torch.zeros(t.shape) for key, t in state.items()}


_NO_WEIGHTS = "has no state_dict (the model's weights) to export"


@pytest.mark.parametrize(
    ("checkpoint", "error", "message"),
    [
        ({"hyper_parameters": {"config": LLAMA, "lora": "x"}, "state_dict": {}}, ckpt.CheckpointMismatchError,
         "hyper_parameters['lora'] is 'x' (a str); expected a dict or None"),
        ({"hyper_parameters": {"config": "abc"}, "state_dict": {}}, ckpt.CheckpointMismatchError,
         "hyper_parameters['config'] is 'abc' (a str); expected a dict or None"),
        ({"hyper_parameters": {"config": LLAMA, "vocab_size": True}, "state_dict": {}}, ckpt.CheckpointMismatchError,
         "hyper_parameters['vocab_size'] is True (a bool); expected an int or None"),
        ({"hyper_parameters": {"config": LLAMA}}, ckpt.CheckpointMismatchError, _NO_WEIGHTS),
        ({"hyper_parameters": {"config": LLAMA}, "state_dict": [1]}, ckpt.CheckpointMismatchError,
         f"{_NO_WEIGHTS} (state_dict is a list, not a dict)"),
        ({"hyper_parameters": "abc", "state_dict": {}}, ckpt.CheckpointMismatchError,
         "has no hyper_parameters to rebuild HFCausalLMModule from (hyper_parameters is a str, not a dict)"),
        ({"hyper_parameters": {"config": {"model_type": "nonexistent_xyz"}}, "state_dict": {}},
         ckpt.CheckpointMismatchError,
         "its hyper_parameters do not build an HFCausalLMModule (ValueError: Unrecognized model identifier"),
        ({"hyper_parameters": {"config": LLAMA}, "state_dict": {"w": torch.zeros(2)}}, ckpt.CheckpointMismatchError,
         "its state_dict does not fit the model its hyper_parameters build: 39 missing keys "
         "['model.model.embed_tokens.weight', "),
        ({"hyper_parameters": {"config": LLAMA}, "state_dict": _llama_state(embed=torch.zeros(3, 32))},
         ckpt.CheckpointMismatchError,
         "its state_dict does not fit the model its hyper_parameters build (Error(s) in loading state_dict for "
         "HFCausalLMModule: size mismatch for model.model.embed_tokens.weight: copying a param with shape "
         "torch.Size([3, 32])"),
        ([1, 2], ckpt.CorruptCheckpointError, "holds a list, not a checkpoint"),
    ],
    ids=["lora-str", "config-str", "vocab-bool", "no-state-dict", "state-dict-list", "hparams-str",
         "unknown-model-type", "other-keys", "other-shape", "not-a-dict"],
)  # fmt: skip
def test_a_checkpoint_it_cannot_export_is_one_line_naming_the_file_and_field(
    tmp_path, capsys, checkpoint, error, message
):
    path = tmp_path / "model.ckpt"
    torch.save(checkpoint, path)
    with pytest.raises(error) as caught:
        export_pretrained(path, tmp_path / "out")
    assert str(path) in str(caught.value) and message in str(caught.value), caught.value
    err = _export_cli(capsys, path, tmp_path / "out")
    assert str(path) in err and message in err, err


@pytest.mark.parametrize("under", ["afile/out", "afile/sub/out"])
def test_an_out_under_a_regular_file_is_one_line_naming_it(tmp_path, capsys, under):
    path = tmp_path / "model.ckpt"
    torch.save({"hyper_parameters": {"config": LLAMA}, "state_dict": {}}, path)
    (tmp_path / "afile").write_text("not a directory")
    output = tmp_path / under
    with pytest.raises(NotADirectoryError, match=f"OUT {str(output)!r} cannot be written: .*afile' is not a dir"):
        export_pretrained(path, output)
    err = _export_cli(capsys, path, output)
    assert f"OUT {str(output)!r} cannot be written: {str(tmp_path / 'afile')!r} is not a directory" in err, err
