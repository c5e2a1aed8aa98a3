"""Remote shards (``datamodules/shard_io.py``): an HTTP server on loopback that serves byte ranges stands in for
S3 / GCS; the DataModule indexes the shards through fsspec, reads each planned sample with range requests, and trains
on exactly what the same shards give when read locally."""

from __future__ import annotations

import io
import re
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
import webdataset as wds

from lightning_mm.datamodules import ImageTextWebDataModule
from lightning_mm.datamodules.synthetic import ensure_synthetic_shards, render_sample
from tests.helpers import LossRecorder, TokenMean, quiet_trainer


class _RangeHandler(SimpleHTTPRequestHandler):
    """``SimpleHTTPRequestHandler`` plus single byte ranges (``206 Partial Content``), as object stores serve them;
    every request is recorded."""

    log: list[tuple[str, str, str | None]] = []

    def log_message(self, *args) -> None:  # (quiet)
        pass

    def send_head(self):
        wanted = self.headers.get("Range")
        type(self).log.append((self.command, self.path, wanted))
        if wanted is None:
            return super().send_head()
        path = self.translate_path(self.path)
        try:
            data = open(path, "rb").read()
        except OSError:
            self.send_error(404)
            return None
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", wanted)
        start = int(match.group(1))
        end = min(int(match.group(2)) if match.group(2) else len(data) - 1, len(data) - 1)
        self.send_response(206)
        self.send_header("Content-Type", "application/x-tar")
        self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        return io.BytesIO(data[start : end + 1])


@pytest.fixture
def served(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    for shard, start in (("train-000000.tar", 0), ("train-000001.tar", 30), ("train-000002.tar", 60)):
        _write(root / shard, start, 30)
    _write(root / "val-000000.tar", 500, 8)
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_RangeHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _RangeHandler.log = []
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _write(path, start: int, count: int) -> None:
    with wds.TarWriter(str(path)) as sink:
        for i in range(start, start + count):
            image, meta = render_sample(i, "train", seed=9, min_short_side=16, max_short_side=80)
            buffer = io.BytesIO()
            image.save(buffer, format="JPEG", quality=90)
            sink.write({"__key__": f"s{i:06d}", "jpg": buffer.getvalue(), "txt": meta["caption"]})


def _dm(train, val, **kwargs) -> ImageTextWebDataModule:
    return ImageTextWebDataModule(
        train_urls=train,
        val_urls=val,
        tokenizer=str(ensure_synthetic_shards("tiny") / "tokenizer.json"),
        patch_size=16,
        max_patches_per_image=16,
        max_text_tokens=32,
        max_patches_per_batch=128,
        max_tokens_per_batch=256,
        rows_per_batch=4,
        **kwargs,
    )


def test_remote_shards_train_one_epoch_equal_to_the_same_shards_read_locally(served, tmp_path):
    root, base = served
    local = _dm(str(root / "train-{000000..000002}.tar"), str(root / "val-000000.tar"), index_dir=str(tmp_path / "l"))
    remote = _dm(f"{base}/train-{{000000..000002}}.tar", f"{base}/val-000000.tar", index_dir=str(tmp_path / "r"))
    expected = list(local.train_dataloader())
    got = list(remote.train_dataloader())
    assert len(got) == len(expected) > 2
    for a, b in zip(got, expected, strict=True):
        for name in ("patches", "patch_pos", "tokens", "labels", "sample_ids", "token_segment", "patch_segment"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert remote._fingerprint()["content"] == local._fingerprint()["content"]
    # Loading read samples by ranges, never a whole shard (the index was built once, front to back).
    gets = [entry for entry in _RangeHandler.log if entry[0] == "GET" and "train" in entry[1]]
    assert gets and all(wanted is not None for _, _, wanted in gets)
    assert sorted((tmp_path / "r").glob("*.lmm-index")) and not list(root.glob("*.lmm-index"))

    # One epoch through a Trainer with loader workers: the same losses as the local shards give.
    losses = {}
    for name, dm in (("local", local), ("remote", remote)):
        recorder = LossRecorder()
        torch.manual_seed(0)
        trainer = quiet_trainer(1, "auto", -1, callbacks=[recorder], max_epochs=1)
        dm.hparams.num_workers = 2
        trainer.fit(TokenMean(), datamodule=dm)
        losses[name] = recorder.losses
    assert losses["remote"] == losses["local"] and len(losses["local"]) == len(expected)


def test_a_missing_remote_shard_and_remote_wildcards_are_refused_naming_them(served, tmp_path):
    _, base = served
    missing = _dm(f"{base}/train-{{000000..000003}}.tar", f"{base}/val-000000.tar", index_dir=str(tmp_path))
    with pytest.raises(
        FileNotFoundError, match=r"1 of 4 listed shard\(s\) missing or unreachable: \['http://.*train-000003\.tar'\]"
    ):
        missing._index("train")
    with pytest.raises(ValueError, match=r"wildcards in remote URLs are not expanded"):
        _dm(f"{base}/train-*.tar", f"{base}/val-000000.tar")._index("train")
    with pytest.raises(ValueError, match=r"is a pipe"):
        _dm("pipe:cat x.tar", f"{base}/val-000000.tar")._index("train")
