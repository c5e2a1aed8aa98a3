"""Reading a caption file's bytes into a caption: the one rule :func:`~lightning_mm.datamodules.decode.index_shard`
and the indexed loader (:class:`~lightning_mm.datamodules.shard_index.SampleTable`) share."""

from __future__ import annotations

import codecs
import json
from collections.abc import Sequence

__all__ = ["caption_from_bytes"]

_MAX_CAPTION_BYTES = 1 << 20
"""Most bytes read of a caption file: a 6 MB caption cost 2 GB downstream (tokenizing all of it), while the model
sees at most ``max_text_tokens`` tokens (a few KiB of text)."""


def caption_from_bytes(
    data: bytes, source: str, is_json: bool, capped: bool, text_keys: Sequence[str] = ()
) -> tuple[str | None, str, str]:
    """A caption file's text, as :func:`index_shard` and the indexed loader (``shard_index``) read it:
    ``(caption, kind, detail)`` as for ``_caption_of``. ``data``: the file's first ``_MAX_CAPTION_BYTES`` bytes;
    ``is_json``: the ``"caption"`` field of a ``json`` file (``source`` names the file in messages); ``capped``:
    the file is longer than ``data``."""
    # (the caption keys the sample lacks, named in the messages about its json)
    no_text = f" and there is no {list(text_keys)}" if text_keys else ""
    try:
        # utf-8-sig: a byte-order mark (Windows editors write one) is not part of the caption. Not final when
        # capped: a character cut at the cap is left out (held back as incomplete), invalid bytes still raise.
        text = codecs.getincrementaldecoder("utf-8-sig")().decode(data, final=not capped)
    except UnicodeDecodeError as err:
        return None, "caption_not_utf8", f"{source!r} is not UTF-8 ({err})"
    if is_json:
        try:
            meta = json.loads(text)
        except (ValueError, RecursionError) as err:
            # ValueError: JSONDecodeError, and an integer of more than 4300 digits (Python's int-from-string
            # limit); RecursionError: deeply nested arrays / objects. Either is this sample's problem only.
            why = f"{type(err).__name__}: {str(err)[:200]}"
            detail = f"'json' is not valid JSON ({why}){no_text}"
            return None, "json_without_caption", detail
        text = meta.get("caption") if isinstance(meta, dict) else None
        if not isinstance(text, str):
            detail = f"'json' has no 'caption' string field{no_text}"
            return None, "json_without_caption", detail
        try:
            # A JSON escape can spell a lone surrogate ("\\ud800"): a str that is not Unicode text, which every
            # tokenizer (and any later encode) rejects. Refused here, per sample, not when the split is tokenized.
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            return None, "caption_not_utf8", f"the caption in 'json' holds a lone surrogate at character {err.start}"
    text = text.strip()
    if not text:
        unread = f" in its first {_MAX_CAPTION_BYTES} bytes (the rest is not read)" if capped else ""
        return None, "caption_missing", f"the caption in {source!r} is empty{unread}"
    return text, "caption_capped" if capped else "", ""
