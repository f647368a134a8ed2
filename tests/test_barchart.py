"""The reward histogram drawn with Pillow: round ticks, bars where their counts put them, the tails grey and
named in a key, and the whole figure the size the report has always had."""

from __future__ import annotations

import io
import math

import pytest
from PIL import Image, ImageFont

from rollflow.tasks.publish import barchart
from rollflow.tasks.publish.barchart import BLUE, DPI, GREY, INK, KEY_FRAME, PAPER, Bar, bar_chart, ticks
from rollflow.tasks.publish.rewards import rewards_png


@pytest.mark.parametrize(
    ("lo", "hi", "whole", "shown"),
    [
        (0.0, 8.4, True, [str(k) for k in range(9)]),
        (0.0, 1685.0, True, [str(k) for k in range(0, 1601, 200)]),
        (0.0, 1.05, True, ["0", "1"]),  # counts: never a step below one
        (0.0, 22.05, True, ["0", "5", "10", "15", "20"]),  # nor of 2.5
        (0.0, 9.0, True, ["0", "2", "4", "6", "8"]),  # ten would be one too many
        (-0.155, 1.155, False, ["0.0", "0.2", "0.4", "0.6", "0.8", "1.0"]),
        (-0.05, 1.05, False, ["0.0", "0.2", "0.4", "0.6", "0.8", "1.0"]),
        (0.0, 0.3, False, ["0.00", "0.05", "0.10", "0.15", "0.20", "0.25", "0.30"]),
        (0.0, 22.0, False, ["0.0", "2.5", "5.0", "7.5", "10.0", "12.5", "15.0", "17.5", "20.0"]),
        (0.0, 2.1e7, True, ["0", "5M", "10M", "15M", "20M"]),  # nine digits do not fit the margin
        (0.0, 2.0e9, True, ["0", "0.5G", "1.0G", "1.5G", "2.0G"]),
        (1.0, 1.0, False, []),
        (2.0, 1.0, False, []),
        (0.0, math.inf, False, []),
        (0.0, math.nan, True, []),
    ],
)
def test_ticks_are_round_values_inside_the_range(lo: float, hi: float, whole: bool, shown: list[str]) -> None:
    got = ticks(lo, hi, whole=whole)
    assert [text for _, text in got] == shown
    assert all(lo <= value <= hi for value, _ in got) and len(got) <= 9


@pytest.mark.parametrize("hi", [1e-12, 9e-8, 1e-9, 0.9, 9.0, 90.0, 1e15 + 1, 3e12, 1e300])
def test_ticks_of_any_range_are_at_most_nine(hi: float) -> None:
    got = ticks(0.0, hi)
    assert 2 <= len(got) <= 9 and all(0.0 <= value <= hi for value, _ in got), got


def _histogram(counts: list[int], below: int = 0, above: int = 0) -> dict:
    bins = [round(k / 10, 1) for k in range(11)]
    hist = {"bins": bins, "counts": counts, "below_0": below, "above_1": above}
    tasks = sum(counts) + below + above
    share = {"share": 0.5 if tasks else 0.0}
    return {
        "task_mean_histogram": hist,
        "tasks": tasks,
        "all_correct": share,
        "none_correct": share,
        "mixed": share,
    }


def _image(png: bytes) -> Image.Image:
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    return Image.open(io.BytesIO(png)).convert("RGB")


def _column(image: Image.Image, x: float, left: float, right: float) -> int:
    """The pixel column at data x of the histogram's x range [left, right] (5% margins, as drawn)."""
    span = right - left
    lo, hi = left - 0.05 * span, right + 0.05 * span
    plot_left, plot_right = 0.85 * DPI, image.width - 0.25 * DPI
    return round(plot_left + (x - lo) / (hi - lo) * (plot_right - plot_left))


def _painted(image: Image.Image, x: int, colour: tuple[int, int, int]) -> int:
    """How many pixels of column x are `colour`: a bar's height in pixels."""
    return sum(1 for y in range(image.height) if image.getpixel((x, y)) == colour)


def test_each_bar_stands_as_high_as_its_count_and_an_empty_bin_draws_nothing() -> None:
    counts = [0, 1, 2, 4, 8, 0, 0, 0, 0, 16]
    image = _image(rewards_png(_histogram(counts)))
    assert image.size == (7 * DPI, 4 * DPI)
    heights = [_painted(image, _column(image, k / 10 + 0.05, 0.0, 1.0), BLUE) for k in range(10)]
    assert heights[0] == heights[5] == 0, heights
    tallest = heights[9]
    for count, height in zip(counts, heights, strict=True):  # in proportion, to the pixel
        assert abs(height - tallest * count / 16) <= 2, (counts, heights)
    plot_height = 4 * DPI - (0.6 + 0.35) * DPI
    assert abs(tallest - plot_height / 1.05) <= 2, tallest  # the top 5% of the axis is margin


def _key_box(image: Image.Image) -> tuple[int, int, int, int] | None:
    """The key's frame (left, top, right, bottom): the rows and columns where its colour runs long (text's
    antialiased edges have that colour too, in short runs); None without a key."""
    rows = [
        y
        for y in range(image.height)
        if sum(image.getpixel((x, y)) == KEY_FRAME for x in range(image.width)) > 30
    ]
    if not rows:
        return None
    cols = [
        x for x in range(image.width) if sum(image.getpixel((x, y)) == KEY_FRAME for y in rows) == len(rows)
    ]
    ys = [y for y in range(rows[0], rows[-1] + 1) if image.getpixel((cols[0], y)) == KEY_FRAME]
    return cols[0], ys[0], cols[-1], ys[-1]


def test_the_tails_are_grey_bars_outside_zero_to_one_and_named_in_a_key() -> None:
    image = _image(rewards_png(_histogram([0] * 5 + [3] * 5, below=6, above=2)))
    below = _painted(image, _column(image, -0.05, -0.1, 1.1), GREY)
    above = _painted(image, _column(image, 1.05, -0.1, 1.1), GREY)
    assert below > 0 and abs(below - 3 * above) <= 3, (below, above)
    box = _key_box(image)
    assert box is not None, "a key"
    left, top, right, bottom = box
    inside = [image.getpixel((x, y)) for x in range(left + 1, right) for y in range(top + 1, bottom)]
    assert inside.count(GREY) >= 2 * 8 * 8 and sum(1 for p in inside if max(p) < 100) > 50, "swatches, words"
    assert _key_box(_image(rewards_png(_histogram([0] * 5 + [3] * 5)))) is None, "no tails, no key"


@pytest.mark.parametrize(
    ("counts", "above", "side"),
    [([50, 10, 8, 6, 5, 6, 8, 12, 30, 400], 380, "left"), ([400, 30, 12, 8, 6, 5, 6, 8, 10, 50], 3, "right")],
)
def test_the_key_goes_in_the_emptier_top_corner_and_covers_no_bar(
    counts: list[int], above: int, side: str
) -> None:
    """RL rewards often pile up at 1: the key then moves left, as matplotlib's legend finds the empty
    corner, and every bar stays whole to its top."""
    image = _image(rewards_png(_histogram(counts, below=3, above=above)))
    box = _key_box(image)
    assert box is not None and (box[2] < image.width / 2) == (side == "left"), box
    centres = [(k / 10 + 0.05, BLUE) for k in range(10)] + [(1.05, GREY)]
    for x, colour in centres:
        column = [image.getpixel((_column(image, x, -0.1, 1.1), y)) for y in range(image.height)]
        painted = [y for y, p in enumerate(column) if p == colour]
        assert painted == list(range(painted[0], painted[-1] + 1)), f"the bar at {x} is covered"


def test_the_tick_labels_and_axis_labels_are_drawn() -> None:
    with_labels = _image(bar_chart([Bar(0, 1, 7)], "t", "mean reward", "tasks"))
    without = _image(bar_chart([Bar(0, 1, 7)], "t", "", ""))
    plot_left, plot_bottom = round(0.85 * DPI), round(4 * DPI - 0.6 * DPI)
    diff = [
        (x, y)
        for x in range(with_labels.width)
        for y in range(with_labels.height)
        if with_labels.getpixel((x, y)) != without.getpixel((x, y))
    ]
    assert diff, "the axis labels drew something"
    assert all(x < plot_left - 20 or y > plot_bottom + 20 for x, y in diff), "only beside and below the plot"
    assert any(x < plot_left - 20 for x, _ in diff) and any(y > plot_bottom + 20 for _, y in diff), "both"
    for value, text in ticks(0, 7 * 1.05, whole=True):  # a label's ink left of each y tick
        y = round(plot_bottom - value / (7 * 1.05) * (plot_bottom - 0.35 * DPI))
        band = [
            without.getpixel((x, yy))
            for x in range(plot_left - 40, plot_left - 6)
            for yy in range(y - 5, y + 6)
        ]
        assert INK in band or any(max(p) < 128 for p in band), text
    for value, text in ticks(-0.05, 1.05):  # and below each x tick
        x = round(plot_left + (value + 0.05) / 1.1 * (7 * DPI - 0.25 * DPI - plot_left))
        band = [
            without.getpixel((xx, y))
            for xx in range(x - 8, x + 9)
            for y in range(plot_bottom + 6, plot_bottom + 25)
        ]
        assert any(max(p) < 128 for p in band), text


def test_counts_of_billions_keep_their_labels_inside_the_figure() -> None:
    """Ticks in G (the margin holds four characters, not ten) and the axis label whole, inside the figure."""
    huge = _histogram([2_000_000_000] + [0] * 9)
    image = _image(rewards_png(huge))
    assert {image.getpixel((x, y)) for x in (0, 1) for y in range(image.height)} == {PAPER}
    unlabelled = _image(bar_chart([Bar(0.0, 0.1, 2e9), Bar(0.9, 0.1, 0)], "t", "x", ""))
    labelled = _image(bar_chart([Bar(0.0, 0.1, 2e9), Bar(0.9, 0.1, 0)], "t", "x", "tasks"))
    drawn = [
        x
        for x in range(image.width)
        for y in range(image.height)
        if unlabelled.getpixel((x, y)) != labelled.getpixel((x, y))
    ]
    assert drawn and min(drawn) >= 2, "the label, whole"


def test_without_freetype_the_bitmap_font_draws_and_cuts_a_title_with_dots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(barchart, "_font", lambda points: ImageFont.load_default_imagefont())
    image = _image(bar_chart([Bar(0, 1, 3, label="above 1")], "x" * 300, "mean", "tasks"))
    assert any(max(image.getpixel((x, y))) < 128 for x in range(image.width) for y in range(30)), "a title"


def test_a_histogram_with_no_tasks_is_drawn_empty() -> None:
    image = _image(rewards_png(_histogram([0] * 10)))
    assert all(_painted(image, x, BLUE) == 0 for x in range(0, image.width, 7))


def _title_ink(image: Image.Image) -> tuple[int, int, int, int] | None:
    """The box of the title's ink (above the plot), or None."""
    top = int(0.35 * DPI)
    ink = [(x, y) for x in range(image.width) for y in range(top) if image.getpixel((x, y)) != PAPER]
    if not ink:
        return None
    return min(x for x, _ in ink), min(y for _, y in ink), max(x for x, _ in ink), max(y for _, y in ink)


@pytest.mark.parametrize(
    ("repeats", "fate"), [(0, "whole"), (4, "whole"), (5, "smaller"), (6, "smaller"), (20, "cut")]
)
def test_a_title_wider_than_the_figure_is_set_smaller_then_cut_short(repeats: int, fate: str) -> None:
    """Up to about 110 characters it is set smaller (12 points down to 8); beyond, it ends in an ellipsis:
    never cut at the figure's edges."""
    title = "rollflow rewards: a very long title" + " a very long title" * (repeats - 1) if repeats else "fly"
    box = _title_ink(_image(bar_chart([Bar(0, 1, 1)], title, "x", "y")))
    full = _title_ink(_image(bar_chart([Bar(0, 1, 1)], "rollflow rewards: a very long title", "x", "y")))
    assert box is not None and full is not None
    assert box[0] >= 2 and box[2] <= 7 * DPI - 3, box  # inside the figure
    height, full_height = box[3] - box[1], full[3] - full[1]  # ascenders to descenders: the font's size
    assert (height < full_height) == (fate != "whole"), (height, full_height)
    wide = _image(bar_chart([Bar(0, 1, 1)], title + "and more", "x", "y"))
    assert (_title_ink(wide) == box) == (fate == "cut"), "only a cut title ends at the same width"
