"""What one sample of the embedded synthetic dataset is: a scene of coloured shapes, its pixels and its caption.

Pictures of coloured shapes on textured backgrounds, paired with English captions that describe only
what is really drawn. The image sizes, aspect ratios and caption lengths mimic the published COYO-700M
statistics (scaled down for CPU), so the data pipeline sees realistic variety (mixed sizes, JPEG and PNG,
short and long captions).

Everything is a pure function of ``(seed, split, index)``: :func:`render_sample` renders the same pixels
and caption for sample ``i`` of a split on any machine, no matter how many samples are generated before
it. A change here changes the bytes of every generated dataset (and so its cached copies): bump
:data:`~lightning_mm.datamodules.synthetic.DATASET_VERSION` with it.

Writing shards, the tokenizer and the cached presets is :mod:`lightning_mm.datamodules.synthetic`, which
re-exports the public names of this module.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

__all__ = [
    "BACKGROUND_COLOURS",
    "BACKGROUND_TEXTURES",
    "COYO_STATS",
    "POSITIONS",
    "SHAPE_COLOURS",
    "SHAPE_KINDS",
    "SHAPE_SIZES",
    "render_sample",
    "sample_image_size",
]

# Source: kakaobrain/coyo-dataset README and its statistics plots. The shared statistics file
# is not shipped with the repo, so the few numbers needed here are copied in. The short-side
# histogram and the caption mean are published; the aspect-ratio model is our assumption
# (COYO publishes only a plot), chosen to give a realistic mix of landscape/portrait images.
COYO_STATS: dict[str, Any] = {
    "source": "kakaobrain/coyo-dataset README and its statistics plots",
    "short_side_histogram": {
        "bin_start_px": [200, 300, 400, 500, 600, 700, 800, 900, 1000, 1100, 1200, 1300, 1400, 1500, 1600],
        "bin_width_px": 100,
        "millions": [207, 152, 107, 74, 68, 37, 27, 12, 24, 3, 8, 2, 2, 3, 1],
    },
    "caption_mean_gpt2_tokens": 17.24,
    "aspect_assumption": {
        "abs_log_aspect_halfnormal_sigma": 0.35,
        "abs_log_aspect_clip": math.log(3.0),
        "landscape_fraction": 0.6,
    },
}

# Split offsets keep the train and val streams disjoint for one seed.
_SPLIT_IDS = {"train": 0, "val": 1}

# name -> RGB. Shape colours are saturated so they stand out; background colours are a
# separate palette and every shape colour is checked for contrast against the background.
SHAPE_COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "orange": (245, 140, 30),
    "yellow": (245, 220, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "purple": (130, 50, 170),
    "pink": (245, 130, 190),
    "cyan": (40, 210, 220),
    "brown": (130, 80, 40),
    "white": (250, 250, 250),
    "black": (15, 15, 15),
}
BACKGROUND_COLOURS: dict[str, tuple[int, int, int]] = {
    "gray": (128, 128, 128),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
    "beige": (225, 210, 175),
    "navy": (25, 35, 90),
    "teal": (30, 120, 120),
    "olive": (110, 110, 40),
    "lavender": (200, 180, 230),
}
SHAPE_KINDS: tuple[str, ...] = (
    "circle",
    "square",
    "triangle",
    "star",
    "cross",
    "ellipse",
    "rectangle",
    "diamond",
    "hexagon",
)
# Size class -> shape radius as a fraction of half the grid cell's shorter side, so a shape
# always fits inside its cell and shapes in different cells never overlap.
SHAPE_SIZES: dict[str, float] = {"small": 0.4, "medium": 0.65, "large": 0.92}
# 3x3 grid, row-major: POSITIONS[row * 3 + col].
POSITIONS: tuple[str, ...] = (
    "top left",
    "top center",
    "top right",
    "middle left",
    "center",
    "middle right",
    "bottom left",
    "bottom center",
    "bottom right",
)
BACKGROUND_TEXTURES: tuple[str, ...] = (
    "plain",
    "horizontal stripes",
    "vertical stripes",
    "checkerboard",
    "noise",
    "gradient",
)

# Caption length model: target GPT-2 token count ~ lognormal. exp(mu + sigma^2 / 2) = 17.3,
# close to COYO's 17.24 mean, and sigma gives a tail past 100 tokens (about 0.2 % of samples).
_CAPTION_LOG_MU = 2.55
_CAPTION_LOG_SIGMA = 0.80
_MIN_CONTRAST = 110.0  # Euclidean RGB distance between a shape colour and the background.
_SHAPE_COUNT_WEIGHTS = (0.3, 0.3, 0.25, 0.15)  # P(1), P(2), P(3), P(4) shapes per image.

_NUMBER_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}
_SIZE_WORDS = {
    "small": ("small", "little", "tiny"),
    "medium": ("medium-sized", "medium", "mid-sized"),
    "large": ("large", "big"),
}
_POSITION_PHRASES = {
    "top left": ("at the top left", "in the top left corner"),
    "top center": ("at the top center", "at the top"),
    "top right": ("at the top right", "in the top right corner"),
    "middle left": ("on the left", "at the middle left"),
    "center": ("in the center", "in the middle"),
    "middle right": ("on the right", "at the middle right"),
    "bottom left": ("at the bottom left", "in the bottom left corner"),
    "bottom center": ("at the bottom center", "at the bottom"),
    "bottom right": ("at the bottom right", "in the bottom right corner"),
}
_BACKGROUND_PHRASES = {
    "plain": ("on a plain {c} background", "on a {c} background"),
    "horizontal stripes": (
        "on a {c} background with horizontal stripes",
        "on a {c} striped background",
        "on a horizontally striped {c} background",
    ),
    "vertical stripes": (
        "on a {c} background with vertical stripes",
        "on a {c} striped background",
        "on a vertically striped {c} background",
    ),
    "checkerboard": ("on a {c} checkerboard background", "on a checkered {c} background"),
    "noise": ("on a noisy {c} background", "on a grainy {c} background"),
    "gradient": ("on a {c} gradient background", "on a shaded {c} background"),
}
_BACKGROUND_DETAILS = {
    "plain": "The background is a flat, uniform {c}.",
    "horizontal stripes": "The background is {c} with horizontal stripes in a second shade of {c}.",
    "vertical stripes": "The background is {c} with vertical stripes in a second shade of {c}.",
    "checkerboard": "The background is a checkerboard of {c} tiles in two shades.",
    "noise": "The background is {c} with fine grainy noise.",
    "gradient": "The background is a {c} gradient, darker at the top and lighter at the bottom.",
}
_TOKEN_RE = re.compile(r"[A-Za-z]+|\d+|[^\sA-Za-z\d]")


# --------------------------------------------------------------------------------------------
# Sampling helpers
# --------------------------------------------------------------------------------------------
def _sample_rng(seed: int, split: str, index: int) -> np.random.Generator:
    """Yield the generator that drives sample ``index`` of ``split``.

    Seeding a ``SeedSequence`` with the triple (instead of ``seed + offset + index``) keeps the
    streams of all (seed, split, index) combinations independent and collision free.
    """
    return np.random.default_rng([seed, _SPLIT_IDS[split], index])


def _pick(rng: np.random.Generator, seq: Sequence[Any]) -> Any:
    """Yield one element of ``seq`` uniformly (as the Python object, not a numpy scalar)."""
    return seq[int(rng.integers(len(seq)))]


def sample_image_size(rng: np.random.Generator, min_short_side: int, max_short_side: int) -> tuple[int, int]:
    """Yield a ``(width, height)`` drawn from the scaled COYO-700M size model.

    The short side follows COYO's short-side histogram (pick a bin by its weight, then a
    uniform pixel value inside it), linearly mapped from [200, 1700) px to
    [min_short_side, max_short_side]. ``|log(aspect)|`` is half-normal (sigma 0.35) clipped at
    log(3); 60 % of images are landscape (width > height).
    """
    hist = COYO_STATS["short_side_histogram"]
    starts = np.asarray(hist["bin_start_px"], dtype=np.float64)
    weights = np.asarray(hist["millions"], dtype=np.float64)
    width_px = float(hist["bin_width_px"])
    lo_px, hi_px = float(starts[0]), float(starts[-1] + width_px)
    b = int(rng.choice(len(starts), p=weights / weights.sum()))
    px = starts[b] + rng.random() * width_px
    short = min_short_side + (px - lo_px) / (hi_px - lo_px) * (max_short_side - min_short_side)
    short_i = int(min(max(round(short), min_short_side), max_short_side))

    aspect_cfg = COYO_STATS["aspect_assumption"]
    log_aspect = min(
        abs(float(rng.normal(0.0, aspect_cfg["abs_log_aspect_halfnormal_sigma"]))), aspect_cfg["abs_log_aspect_clip"]
    )
    landscape = bool(rng.random() < aspect_cfg["landscape_fraction"])
    # Rounding could push the ratio a hair past 3, so clamp the long side explicitly.
    long_i = int(min(max(round(short_i * math.exp(log_aspect)), short_i), 3 * short_i))
    return (long_i, short_i) if landscape else (short_i, long_i)


def _rgb_distance(a: Sequence[int], b: Sequence[int]) -> float:
    """Yield the Euclidean distance between two RGB triples."""
    return float(math.sqrt(sum((int(x) - int(y)) ** 2 for x, y in zip(a, b, strict=True))))


def _sample_scene(rng: np.random.Generator, width: int, height: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Yield ``(background, shapes)``: what to draw, as JSON-ready dicts.

    Shapes occupy distinct grid cells and distinct (colour, kind) pairs, so phrases such as
    "the red circle" are unambiguous and "above"/"left of" relations follow from the cells.
    Shapes are ordered largest size class first; captions name ``shapes[0]`` first.
    """
    bg_name = _pick(rng, list(BACKGROUND_COLOURS))
    texture = _pick(rng, BACKGROUND_TEXTURES)
    period_frac = float(rng.uniform(0.06, 0.16))
    background = {"colour": bg_name, "texture": texture, "period_frac": round(period_frac, 4)}

    n = int(rng.choice(len(_SHAPE_COUNT_WEIGHTS), p=np.asarray(_SHAPE_COUNT_WEIGHTS))) + 1
    cells = [int(c) for c in rng.choice(len(POSITIONS), size=n, replace=False)]
    colours = [
        c
        for c, rgb in SHAPE_COLOURS.items()
        if c != bg_name and _rgb_distance(rgb, BACKGROUND_COLOURS[bg_name]) >= _MIN_CONTRAST
    ]
    cell_w, cell_h = width / 3.0, height / 3.0
    half_cell = min(cell_w, cell_h) / 2.0

    shapes: list[dict[str, Any]] = []
    used: set[tuple[str, str]] = set()
    for cell in cells:
        # Rejection sampling for a fresh (colour, kind) pair; the space has > 60 pairs, so
        # this terminates almost immediately.
        while True:
            kind = _pick(rng, SHAPE_KINDS)
            colour = _pick(rng, colours)
            if (colour, kind) not in used:
                used.add((colour, kind))
                break
        size = _pick(rng, list(SHAPE_SIZES))
        outline_choice = float(rng.random())
        outline = None
        if outline_choice >= 0.6:
            outline = "black" if colour != "black" else "white"
            if outline_choice >= 0.8 and colour != "white":
                outline = "white"
        jx, jy = float(rng.uniform(-1.0, 1.0)), float(rng.uniform(-1.0, 1.0))

        r = max(1.5, SHAPE_SIZES[size] * half_cell)
        ex, ey = r, (0.55 * r if kind in ("ellipse", "rectangle") else r)
        row, col = divmod(cell, 3)
        cx = (col + 0.5) * cell_w + jx * max(0.0, cell_w / 2.0 - ex - 0.5)
        cy = (row + 0.5) * cell_h + jy * max(0.0, cell_h / 2.0 - ey - 0.5)
        shapes.append(
            {
                "kind": kind,
                "colour": colour,
                "size": size,
                "position": POSITIONS[cell],
                "outline": outline,
                "center": [round(cx, 2), round(cy, 2)],
                "radius": round(r, 2),
            }
        )
    size_rank = {name: i for i, name in enumerate(SHAPE_SIZES)}
    shapes.sort(key=lambda s: -size_rank[s["size"]])  # stable: ties keep sampling order
    return background, shapes


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------
def _render_background(rng: np.random.Generator, width: int, height: int, background: dict[str, Any]) -> np.ndarray:
    """Yield the ``(height, width, 3)`` uint8 background texture."""
    base = np.asarray(BACKGROUND_COLOURS[background["colour"]], dtype=np.float32)
    # The second shade goes towards mid-gray so stripes stay visible on black and white.
    luminance = float(base @ np.asarray([0.299, 0.587, 0.114], dtype=np.float32))
    alt = base * 0.75 if luminance > 110 else base + (255.0 - base) * 0.3
    texture = background["texture"]
    period = max(2, round(min(width, height) * background["period_frac"]))
    half = max(1, period // 2)
    ys = np.arange(height)[:, None]
    xs = np.arange(width)[None, :]
    if texture == "plain":
        mask = np.zeros((height, width), dtype=bool)
    elif texture == "horizontal stripes":
        mask = np.broadcast_to((ys // half) % 2 == 1, (height, width))
    elif texture == "vertical stripes":
        mask = np.broadcast_to((xs // half) % 2 == 1, (height, width))
    elif texture == "checkerboard":
        mask = ((ys // period) + (xs // period)) % 2 == 1
    elif texture == "noise":
        noise = rng.integers(-24, 25, size=(height, width, 1)).astype(np.float32)
        return np.clip(base[None, None, :] + noise, 0, 255).astype(np.uint8)
    elif texture == "gradient":
        dark, light = base * 0.7, base + (255.0 - base) * 0.3
        t = (np.arange(height, dtype=np.float32) / max(1, height - 1))[:, None, None]
        img = dark[None, None, :] * (1.0 - t) + light[None, None, :] * t
        return np.broadcast_to(np.round(img), (height, width, 3)).astype(np.uint8)
    else:  # pragma: no cover - textures come from BACKGROUND_TEXTURES
        raise ValueError(f"unknown texture {texture!r}")
    img = np.where(mask[:, :, None], alt[None, None, :], base[None, None, :])
    return np.round(img).astype(np.uint8)


def _shape_outline_points(kind: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    """Yield the polygon vertices of a polygonal shape kind centred on (cx, cy)."""
    if kind == "square":
        s = 0.8 * r
        return [(cx - s, cy - s), (cx + s, cy - s), (cx + s, cy + s), (cx - s, cy + s)]
    if kind == "rectangle":
        hy = 0.55 * r
        return [(cx - r, cy - hy), (cx + r, cy - hy), (cx + r, cy + hy), (cx - r, cy + hy)]
    if kind == "triangle":
        # Equilateral, pointing up, centroid on (cx, cy).
        return [(cx, cy - r), (cx + 0.866 * r, cy + 0.5 * r), (cx - 0.866 * r, cy + 0.5 * r)]
    if kind == "diamond":
        return [(cx, cy - r), (cx + 0.7 * r, cy), (cx, cy + r), (cx - 0.7 * r, cy)]
    if kind == "hexagon":
        return [(cx + r * math.cos(a), cy + r * math.sin(a)) for a in np.linspace(0, 2 * math.pi, 7)[:-1]]
    if kind == "star":
        pts = []
        for i in range(10):
            a = -math.pi / 2 + i * math.pi / 5
            rad = r if i % 2 == 0 else 0.45 * r
            pts.append((cx + rad * math.cos(a), cy + rad * math.sin(a)))
        return pts
    if kind == "cross":
        t = 0.3 * r
        return [
            (cx - t, cy - r),
            (cx + t, cy - r),
            (cx + t, cy - t),
            (cx + r, cy - t),
            (cx + r, cy + t),
            (cx + t, cy + t),
            (cx + t, cy + r),
            (cx - t, cy + r),
            (cx - t, cy + t),
            (cx - r, cy + t),
            (cx - r, cy - t),
            (cx - t, cy - t),
        ]
    raise ValueError(f"unknown polygon kind {kind!r}")  # pragma: no cover


def _draw_shape(draw: ImageDraw.ImageDraw, shape: dict[str, Any], width: int, height: int) -> list[int]:
    """Draw one shape and yield its pixel bounding box ``[x0, y0, x1, y1]`` (inclusive)."""
    cx, cy = shape["center"]
    r = shape["radius"]
    fill = SHAPE_COLOURS[shape["colour"]]
    outline = SHAPE_COLOURS[shape["outline"]] if shape["outline"] else None
    line_w = max(1, round(r / 7.0))
    if shape["kind"] in ("circle", "ellipse"):
        ry = r if shape["kind"] == "circle" else 0.55 * r
        box = [cx - r, cy - ry, cx + r, cy + ry]
        draw.ellipse(box, fill=fill, outline=outline, width=line_w)
    else:
        pts = _shape_outline_points(shape["kind"], cx, cy, r)
        draw.polygon(pts, fill=fill, outline=outline, width=line_w)
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        box = [min(xs), min(ys), max(xs), max(ys)]
    return [
        max(0, math.floor(box[0])),
        max(0, math.floor(box[1])),
        min(width - 1, math.ceil(box[2])),
        min(height - 1, math.ceil(box[3])),
    ]


# --------------------------------------------------------------------------------------------
# Captions
# --------------------------------------------------------------------------------------------
def _approx_gpt2_tokens(text: str) -> int:
    """Yield an estimate of the GPT-2 token count (words, numbers and punctuation marks).

    The caption vocabulary is common English words, which GPT-2 encodes as one token each,
    so this estimate is close without shipping the GPT-2 vocabulary.
    """
    return len(_TOKEN_RE.findall(text))


def _article(phrase: str) -> str:
    """Yield ``phrase`` prefixed with "a" or "an"."""
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


def _plural(kind: str, count: int) -> str:
    """Yield ``kind`` in the plural when ``count`` != 1 ("crosses", "circles")."""
    if count == 1:
        return kind
    return kind + ("es" if kind.endswith(("s", "x", "ch", "sh")) else "s")


def _join(parts: Sequence[str]) -> str:
    """Yield "x", "x and y" or "x, y and z"."""
    if len(parts) == 1:
        return parts[0]
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def _capitalize(text: str) -> str:
    """Yield ``text`` with its first letter upper-cased."""
    return text[:1].upper() + text[1:]


def _caption_candidates(
    rng: np.random.Generator,
    shapes: list[dict[str, Any]],
    background: dict[str, Any],
    width: int,
    height: int,
) -> list[str]:
    """Yield true captions of the scene, ordered from terse to very detailed.

    Every candidate names at least ``shapes[0]`` by colour and kind and only states facts
    derived from the scene description (cells, size classes, outline, background texture).
    """
    bg_colour = background["colour"]
    size_word = [_pick(rng, _SIZE_WORDS[s["size"]]) for s in shapes]
    pos_phrase = [_pick(rng, _POSITION_PHRASES[s["position"]]) for s in shapes]
    bg_phrase = _pick(rng, _BACKGROUND_PHRASES[background["texture"]]).format(c=bg_colour)
    name = [f"{s['colour']} {s['kind']}" for s in shapes]

    def outline_phrase(s: dict[str, Any]) -> str:
        if not s["outline"]:
            return ""
        return _pick(rng, (f" with a {s['outline']} outline", f" outlined in {s['outline']}"))

    # Single-phrase, alt-text style candidates.
    phrases: list[str] = [f"{name[0]}."]
    phrases.append(_join([_article(n) for n in name]) + ".")
    sized = [f"{w} {n}" for w, n in zip(size_word, name, strict=True)]
    phrases.append(_join([_article(n) for n in sized]) + ".")
    placed = [f"{_article(n)} {p}" for n, p in zip(sized, pos_phrase, strict=True)]
    phrases.append(_join(placed) + ".")
    phrases.append(_join(placed) + f" {bg_phrase}.")
    if rng.random() < 0.5:
        phrases = [_capitalize(p) for p in phrases]

    # Multi-sentence candidates: an opening sentence, one sentence per shape, then extra facts.
    n = len(shapes)
    if n == 1:
        opening = _pick(rng, (f"There is one shape {bg_phrase}.", f"A single shape {bg_phrase}."))
    else:
        opening = _pick(
            rng,
            (
                f"There are {_NUMBER_WORDS[n]} shapes {bg_phrase}.",
                f"{_capitalize(_NUMBER_WORDS[n])} shapes {bg_phrase}.",
            ),
        )
    verbs = ("is", "sits", "appears")
    shape_sentences = [
        _capitalize(f"{_article(sized[i])}{outline_phrase(s)} {_pick(rng, verbs)} {pos_phrase[i]}.")
        for i, s in enumerate(shapes)
    ]

    extras: list[str] = [_BACKGROUND_DETAILS[background["texture"]].format(c=bg_colour)]
    if width == height:
        extras.append("The image is exactly as wide as it is tall.")
    elif width > height:
        extras.append("The image is wider than it is tall.")
    else:
        extras.append("The image is taller than it is wide.")
    if n == 1:
        s = shapes[0]
        extras.append(f"The {s['kind']} is {s['colour']}.")
        extras.append(f"The {name[0]} is the only shape in the picture.")
    else:
        kinds: dict[str, int] = {}
        for s in shapes:
            kinds[s["kind"]] = kinds.get(s["kind"], 0) + 1
        counts = [f"{_NUMBER_WORDS[c]} {_plural(k, c)}" for k, c in kinds.items()]
        extras.append("There are " + _join(counts) + ".")
        colours = list(dict.fromkeys(s["colour"] for s in shapes))
        if len(colours) == 1:
            extras.append(f"All of the shapes are {colours[0]}.")
        else:
            extras.append(f"The shapes are {_join(colours)}.")
        outlined = [name[i] for i, s in enumerate(shapes) if s["outline"]]
        if not outlined:
            extras.append("None of the shapes has an outline.")
        elif len(outlined) == 1:
            extras.append(f"Only the {outlined[0]} has an outline.")
        elif len(outlined) == n:
            extras.append("Every shape has an outline.")
        else:
            extras.append(f"{_capitalize(_NUMBER_WORDS[len(outlined)])} of the shapes have outlines.")
        rank = {name_: i for i, name_ in enumerate(SHAPE_SIZES)}
        top = [i for i, s in enumerate(shapes) if s["size"] == shapes[0]["size"]]
        if len(top) == 1:
            extras.append(f"The largest shape is the {name[0]}.")
        for i in range(n):
            for j in range(i + 1, n):
                ri, ci = divmod(POSITIONS.index(shapes[i]["position"]), 3)
                rj, cj = divmod(POSITIONS.index(shapes[j]["position"]), 3)
                vertical = "above" if ri < rj else "below" if ri > rj else ""
                horizontal = "to the left of" if ci < cj else "to the right of" if ci > cj else ""
                rel = " and ".join(p for p in (vertical, horizontal) if p)
                extras.append(f"The {name[i]} is {rel} the {name[j]}.")
                si, sj = rank[shapes[i]["size"]], rank[shapes[j]["size"]]
                if si != sj:
                    comparison = "larger" if si > sj else "smaller"
                    extras.append(f"The {name[i]} is {comparison} than the {name[j]}.")
    order = rng.permutation(len(extras))
    body = [opening, *shape_sentences, *(extras[int(k)] for k in order)]
    # Start at two sentences: the opening alone names no shape.
    sentences = [" ".join(body[:k]) for k in range(2, len(body) + 1)]
    return phrases + sentences


def _make_caption(
    rng: np.random.Generator,
    shapes: list[dict[str, Any]],
    background: dict[str, Any],
    width: int,
    height: int,
) -> str:
    """Yield the caption whose length is closest to a lognormal target token count."""
    target = float(np.exp(rng.normal(_CAPTION_LOG_MU, _CAPTION_LOG_SIGMA)))
    candidates = _caption_candidates(rng, shapes, background, width, height)
    return min(candidates, key=lambda c: abs(_approx_gpt2_tokens(c) - target))


def render_sample(
    index: int,
    split: str = "train",
    seed: int = 0,
    min_short_side: int = 32,
    max_short_side: int = 256,
    png_fraction: float = 0.2,
) -> tuple[Image.Image, dict[str, Any]]:
    """Yield ``(image, metadata)`` for sample ``index`` of ``split``.

    The result depends only on the arguments. ``metadata`` holds ``sample_id``, ``split``,
    ``width``, ``height``, ``shapes`` (kind, colour, size, position, outline, center, radius,
    bbox), ``background`` (colour, texture, period_frac), ``caption`` and ``image_format``
    (``"jpg"`` or ``"png"``).
    """
    if split not in _SPLIT_IDS:
        raise ValueError(f"split must be one of {sorted(_SPLIT_IDS)}, got {split!r}")
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    rng = _sample_rng(seed, split, index)
    # Drawn first so png_fraction does not shift the rest of the stream: the same pixels come
    # out whatever fraction is requested.
    format_u = float(rng.random())
    width, height = sample_image_size(rng, min_short_side, max_short_side)
    background, shapes = _sample_scene(rng, width, height)
    caption = _make_caption(rng, shapes, background, width, height)
    # Noise textures draw last, because how many values they draw depends on the image size.
    image = Image.fromarray(_render_background(rng, width, height, background))
    draw = ImageDraw.Draw(image)
    for shape in shapes:
        shape["bbox"] = _draw_shape(draw, shape, width, height)
    metadata = {
        "sample_id": index,
        "split": split,
        "width": width,
        "height": height,
        "shapes": shapes,
        "background": background,
        "caption": caption,
        "image_format": "png" if format_u < png_fraction else "jpg",
    }
    return image, metadata
