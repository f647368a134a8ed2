"""A bar chart drawn with Pillow: the reward histogram every run's report carries, in milliseconds, where
matplotlib's import alone took half a second of each run (the tuning and control plots, drawn only when
those ran, keep matplotlib)."""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFont

DPI = 110  # as the matplotlib figures: a 7 x 4 in chart is 770 x 440 pixels
BLUE, GREY = (31, 119, 180), (127, 127, 127)  # matplotlib's tab:blue and tab:gray, as the other figures
INK, PAPER = (0, 0, 0), (255, 255, 255)
# Margins in inches, as plot.py's: room for tick labels and the axis label (left, bottom) and the title.
LEFT_IN, RIGHT_IN, BOTTOM_IN, TOP_IN = 0.85, 0.25, 0.6, 0.35
TICK_PX, PAD_PX = 5, 4
Font = ImageFont.FreeTypeFont | ImageFont.ImageFont


@dataclass(frozen=True)
class Bar:
    """One bar: its left edge and width on x, its height; a label names its colour in the legend; an edge
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
    """The bars on white with a framed plot area, ticks at round values, the labels and title; PNG bytes."""
    width, height = round(size_in[0] * DPI), round(size_in[1] * DPI)
    image = Image.new("RGB", (width, height), PAPER)
    draw = ImageDraw.Draw(image)
    left, right = LEFT_IN * DPI, width - RIGHT_IN * DPI
    top, bottom = TOP_IN * DPI, height - BOTTOM_IN * DPI
    xs = _padded(min(b.x for b in bars), max(b.x + b.width for b in bars)) if bars else (0.0, 1.0)
    x_axis = Axis(*xs, left, right)
    y_axis = Axis(0.0, max([b.height for b in bars if b.height > 0], default=1.0) * 1.05, bottom, top)
    for bar in bars:
        if bar.height > 0:
            box = (x_axis.px(bar.x), y_axis.px(bar.height), x_axis.px(bar.x + bar.width), bottom)
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
    _vertical_text(image, (beside - PAD_PX, (top + bottom) / 2), ylabel, font)
    font, title = _fitting(draw, title, width - 2 * PAD_PX)
    half = draw.textlength(title, font=font) / 2  # centred on the plot, but never past the figure's edges
    centre = min(max((left + right) / 2, PAD_PX + half), width - PAD_PX - half)
    _text(draw, (centre, top - PAD_PX), title, font, "above")
    _legend(draw, bars, (right - 2 * PAD_PX, top + 2 * PAD_PX))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def ticks(lo: float, hi: float, whole: bool = False, most: int = 9) -> list[tuple[float, str]]:
    """Round values in [lo, hi] at a step of 1, 2, 2.5 or 5 times a power of ten, at most `most` of them,
    with as many decimals as the step needs (whole: the step is at least 1, as counts are)."""
    raw = (hi - lo) / most
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw * (1 - 1e-9))
    if whole:
        step = max(1.0, step)
    decimals = next(d for d in range(8) if abs(round(step, d) - step) < step * 1e-9)
    first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
    return [(round(k * step, 12), f"{k * step:.{decimals}f}") for k in range(first, last + 1)]


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


def _fitting(draw: ImageDraw.ImageDraw, text: str, room: float) -> tuple[Font, str]:
    """The title's font and text: 12 points, smaller (down to 8) when the title would not fit the width,
    then cut short with an ellipsis."""
    for points in (12, 11, 10, 9, 8):
        font = _font(points)
        if draw.textlength(text, font=font) <= room:
            return font, text
    while len(text) > 1 and draw.textlength(text + "…", font=font) > room:
        text = text[:-1]
    return font, text.rstrip() + "…"


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


def _vertical_text(image: Image.Image, at: tuple[float, float], text: str, font: Font) -> None:
    """`text` turned a quarter left (read bottom to top), its right edge at at[0], centred on at[1]."""
    probe = ImageDraw.Draw(image)
    x0, y0, x1, y1 = probe.textbbox((0, 0), text, font=font)
    strip = Image.new("L", (x1 - x0, y1 - y0), 0)
    ImageDraw.Draw(strip).text((-x0, -y0), text, font=font, fill=255)
    turned = strip.rotate(90, expand=True)
    ink = Image.new("RGB", turned.size, INK)
    image.paste(ink, (round(at[0] - turned.width), round(at[1] - turned.height / 2)), turned)


def _legend(draw: ImageDraw.ImageDraw, bars: Sequence[Bar], top_right: tuple[float, float]) -> None:
    """A framed key in the top right corner: a swatch and the label of each labelled colour, once."""
    entries = list({b.label: b.color for b in bars if b.label and b.height > 0}.items())
    if not entries:
        return
    font = _font(8)
    line = max(draw.textbbox((0, 0), label, font=font)[3] for label, _ in entries) + PAD_PX
    swatch = line - PAD_PX
    text_w = max(draw.textbbox((0, 0), label, font=font)[2] for label, _ in entries)
    w, h = swatch + 3 * PAD_PX + text_w, len(entries) * line + PAD_PX
    x, y = top_right[0] - w, top_right[1]
    draw.rectangle([round(x), round(y), round(x + w), round(y + h)], fill=PAPER, outline=(204, 204, 204))
    for i, (label, color) in enumerate(entries):
        row = y + PAD_PX + i * line
        draw.rectangle(
            [round(x + PAD_PX), round(row), round(x + PAD_PX + swatch), round(row + swatch)], fill=color
        )
        draw.text((round(x + 2 * PAD_PX + swatch), round(row)), label, font=font, fill=INK)
