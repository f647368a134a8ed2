"""A bar chart drawn with Pillow: the reward histogram every run's report carries, in milliseconds, where
matplotlib's import alone took half a second of each run (the tuning and control plots, drawn only when
those ran, keep matplotlib). Its font is Pillow's own, so a machine needs no system fonts; it draws ASCII
text, as the report's labels are."""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFont

# the matplotlib figures' resolution and margins, so that every figure of a report has the same frame
from rollflow.tasks.publish.plot import BOTTOM_IN, DPI, LEFT_IN, RIGHT_IN, TOP_IN

BLUE, GREY = (31, 119, 180), (127, 127, 127)  # matplotlib's tab:blue and tab:gray, as the other figures
INK, PAPER, KEY_FRAME = (0, 0, 0), (255, 255, 255), (204, 204, 204)
TICK_PX, PAD_PX = 5, 4
SI = ((1e12, "T"), (1e9, "G"), (1e6, "M"))  # counts of a million and more: "1.5M", not nine digits
Font = ImageFont.FreeTypeFont | ImageFont.ImageFont


@dataclass(frozen=True)
class Bar:
    """One bar: its left edge and width on x, its height; a label names its colour in the key; an edge
    colour outlines it (white parts neighbours)."""

    x: float
    width: float
    height: float
    color: tuple[int, int, int] = BLUE
    label: str | None = None
    edge: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class Axis:
    """Data range [lo, hi] drawn over pixels [start, end] (end < start for y, which grows upward)."""

    lo: float
    hi: float
    start: float
    end: float

    def px(self, value: float) -> float:
        return self.start + (value - self.lo) / (self.hi - self.lo) * (self.end - self.start)


def bar_chart(
    bars: Sequence[Bar], title: str, xlabel: str, ylabel: str, size_in: tuple[float, float] = (7, 4)
) -> bytes:
    """The bars on white with a framed plot area, ticks at round values, the labels, the title and a key of
    the labelled colours in the emptier top corner; PNG bytes."""
    width, height = round(size_in[0] * DPI), round(size_in[1] * DPI)
    image = Image.new("RGB", (width, height), PAPER)
    draw = ImageDraw.Draw(image)
    left, right = LEFT_IN * DPI, width - RIGHT_IN * DPI
    top, bottom = TOP_IN * DPI, height - BOTTOM_IN * DPI
    placed = [b for b in bars if math.isfinite(b.x) and math.isfinite(b.width)]  # empty bins span x too
    shown = [b for b in placed if b.height > 0 and math.isfinite(b.height)]
    xs = _padded(min(b.x for b in placed), max(b.x + b.width for b in placed)) if placed else (0.0, 1.0)
    x_axis = Axis(*xs, left, right)
    y_axis = Axis(0.0, max((b.height for b in shown), default=1.0) * 1.05, bottom, top)
    boxes = [(x_axis.px(b.x), y_axis.px(b.height), x_axis.px(b.x + b.width), bottom) for b in shown]
    for bar, box in zip(shown, boxes, strict=True):
        draw.rectangle([round(v) for v in box], fill=bar.color, outline=bar.edge)
    draw.rectangle([round(left), round(top), round(right), round(bottom)], outline=INK)
    font = _font(10)
    below = bottom + TICK_PX + PAD_PX
    for value, text in ticks(x_axis.lo, x_axis.hi):
        x = round(x_axis.px(value))
        draw.line([(x, bottom), (x, bottom + TICK_PX)], fill=INK)
        below = max(below, _text(draw, (x, bottom + TICK_PX + PAD_PX), text, font, "top")[3])
    beside = left - TICK_PX - PAD_PX
    for value, text in ticks(0.0, y_axis.hi, whole=True):
        y = round(y_axis.px(value))
        draw.line([(left - TICK_PX, y), (left, y)], fill=INK)
        beside = min(beside, _text(draw, (left - TICK_PX - PAD_PX, y), text, font, "right")[0])
    _text(draw, ((left + right) / 2, below + PAD_PX), xlabel, font, "top")
    _vertical_text(image, draw, (beside - PAD_PX, (top + bottom) / 2), ylabel, font)
    _title(draw, " ".join(title.split()), (left + right) / 2, top - PAD_PX, width)
    _key(draw, shown, boxes, (left + 2 * PAD_PX, right - 2 * PAD_PX, top + 2 * PAD_PX))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def ticks(lo: float, hi: float, whole: bool = False, most: int = 9) -> list[tuple[float, str]]:
    """Round values in [lo, hi], at most `most`, at a step of 1, 2, 2.5 or 5 times a power of ten (whole:
    1, 2 or 5 and at least 1, as counts are), labelled with the decimals the step needs; from a million
    on, in millions (M), billions (G) or trillions (T). No range, no ticks."""
    span = (hi - lo) / most if math.isfinite(lo) and math.isfinite(hi) else 0.0
    if not span > 0:
        return []
    magnitude = 10.0 ** math.floor(math.log10(span))
    if whole:
        magnitude = max(magnitude, 1.0)
    steps = (m * magnitude * 10**k for k in range(3) for m in ((1, 2, 5) if whole else (1, 2, 2.5, 5)))
    for step in steps:
        first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
        if last - first + 1 <= most:
            break
    scale, suffix = next(((s, name) for s, name in SI if max(abs(lo), abs(hi)) >= s), (1.0, ""))
    shown = step / scale
    decimals = next((d for d in range(16) if abs(round(shown, d) - shown) <= shown * 1e-9), 15)
    return [(round(k * step, 12), _label(k * step, scale, suffix, decimals)) for k in range(first, last + 1)]


def _label(value: float, scale: float, suffix: str, decimals: int) -> str:
    """A tick's text in the scale's unit with its suffix ("1.5M"); zero is a bare 0 when scaled."""
    return "0" if suffix and value == 0 else f"{value / scale:.{decimals}f}{suffix}"


def _padded(lo: float, hi: float) -> tuple[float, float]:
    """The data range with 5% of it as margin each side, as matplotlib's autoscale."""
    margin = (hi - lo) * 0.05 or 0.5
    return lo - margin, hi + margin


@functools.cache
def _font(points: float) -> Font:
    """Pillow's own scalable font at `points` (no system font needed); its bitmap font without FreeType."""
    try:
        return ImageFont.load_default(size=points * DPI / 72)
    except ImportError:  # Pillow built without FreeType: the fixed bitmap font, smaller but legible
        return ImageFont.load_default()


def _title(draw: ImageDraw.ImageDraw, title: str, centre: float, baseline: float, width: int) -> None:
    """The title at 12 points, smaller (down to 8) when it would not fit the figure's width, then cut short
    with an ellipsis; centred on the plot, but never past the figure's edges."""
    room = width - 2 * PAD_PX
    for points in (12, 11, 10, 9, 8):
        font = _font(points)
        if draw.textlength(title, font=font) <= room:
            break
    else:
        title = _cut(draw, title, font, room)
    half = draw.textlength(title, font=font) / 2
    _text(draw, (min(max(centre, PAD_PX + half), width - PAD_PX - half), baseline), title, font, "above")


def _cut(draw: ImageDraw.ImageDraw, text: str, font: Font, room: float) -> str:
    """The longest start of `text` that fits `room` with an ellipsis after it (found by halving)."""
    ellipsis = "\u2026" if isinstance(font, ImageFont.FreeTypeFont) else "..."  # the bitmap font is Latin-1
    fits, over = 0, len(text)
    while over - fits > 1:
        mid = (fits + over) // 2
        fits, over = (mid, over) if draw.textlength(text[:mid] + ellipsis, font=font) <= room else (fits, mid)
    return text[:fits].rstrip() + ellipsis


def _text(
    draw: ImageDraw.ImageDraw, at: tuple[float, float], text: str, font: Font, side: str
) -> tuple[int, int, int, int]:
    """`text` centred on x below `at` ("top") or above it ("above"), or right-aligned to it and centred
    on y ("right"); placed by its measured box, as the bitmap font takes no anchors. Returns that box."""
    x0, y0, x1, y1 = draw.textbbox((0, 0), text, font=font)
    w, h = x1 - x0, y1 - y0
    x, y = at
    if side == "right":
        origin = (x - w, y - h / 2)
    elif side == "top":
        origin = (x - w / 2, y)
    else:
        origin = (x - w / 2, y - h)
    left, top = round(origin[0]), round(origin[1])
    draw.text((left - x0, top - y0), text, font=font, fill=INK)
    return left, top, left + w, top + h


def _vertical_text(
    image: Image.Image, draw: ImageDraw.ImageDraw, at: tuple[float, float], text: str, font: Font
) -> None:
    """`text` turned a quarter left (read bottom to top), its right edge at at[0] (inside the figure),
    centred on at[1]."""
    x0, y0, x1, y1 = draw.textbbox((0, 0), text, font=font)
    if x1 <= x0:
        return
    strip = Image.new("L", (x1 - x0, y1 - y0), 0)
    ImageDraw.Draw(strip).text((-x0, -y0), text, font=font, fill=255)
    turned = strip.rotate(90, expand=True)
    ink = Image.new("RGB", turned.size, INK)
    left = max(1, round(at[0] - turned.width))
    image.paste(ink, (left, round(at[1] - turned.height / 2)), turned)


def _key(
    draw: ImageDraw.ImageDraw,
    bars: Sequence[Bar],
    boxes: Sequence[tuple[float, float, float, float]],
    inside: tuple[float, float, float],
) -> None:
    """A framed key of each labelled colour, once, in the top corner (right, else left) whose bars reach
    least into it, as matplotlib's legend finds the emptiest place."""
    entries = list({b.label: b.color for b in bars if b.label}.items())
    if not entries:
        return
    font = _font(8)
    line = max(draw.textbbox((0, 0), label, font=font)[3] for label, _ in entries) + PAD_PX
    swatch = line - PAD_PX
    w = swatch + 3 * PAD_PX + max(draw.textlength(label, font=font) for label, _ in entries)
    h = len(entries) * line + PAD_PX
    left_edge, right_edge, y = inside

    def covered(x: float) -> float:
        """How far bars reach into a key at x: the pixels of bar under it, summed."""
        return sum(max(0.0, y + h - top) for x0, top, x1, _ in boxes if x0 < x + w and x1 > x)

    x = min((right_edge - w, left_edge), key=covered)  # the right corner unless the left is emptier
    draw.rectangle([round(x), round(y), round(x + w), round(y + h)], fill=PAPER, outline=KEY_FRAME)
    for i, (label, color) in enumerate(entries):
        row = y + PAD_PX + i * line
        draw.rectangle(
            [round(x + PAD_PX), round(row), round(x + PAD_PX + swatch), round(row + swatch)], fill=color
        )
        draw.text((round(x + 2 * PAD_PX + swatch), round(row)), label, font=font, fill=INK)
