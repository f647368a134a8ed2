"""The reward histogram drawn with Pillow: round ticks, bars where their counts put them, the tails grey and
named in a key, and the whole figure the size the report has always had."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from rollflow.tasks.publish.barchart import BLUE, DPI, GREY, PAPER, Bar, bar_chart, ticks
from rollflow.tasks.publish.rewards import rewards_png


@pytest.mark.parametrize(
    ("lo", "hi", "whole", "shown"),
    [
        (0.0, 8.4, True, [str(k) for k in range(9)]),
        (0.0, 1685.0, True, [str(k) for k in range(0, 1601, 200)]),
        (0.0, 1.05, True, ["0", "1"]),  # counts: never a step below one
        (-0.155, 1.155, False, ["0.0", "0.2", "0.4", "0.6", "0.8", "1.0"]),
        (-0.05, 1.05, False, ["0.0", "0.2", "0.4", "0.6", "0.8", "1.0"]),
        (0.0, 0.3, False, ["0.00", "0.05", "0.10", "0.15", "0.20", "0.25", "0.30"]),
        (0.0, 22.0, False, ["0.0", "2.5", "5.0", "7.5", "10.0", "12.5", "15.0", "17.5", "20.0"]),
    ],
)
def test_ticks_are_round_values_inside_the_range(lo: float, hi: float, whole: bool, shown: list[str]) -> None:
    got = ticks(lo, hi, whole=whole)
    assert [text for _, text in got] == shown
    assert all(lo <= value <= hi for value, _ in got) and len(got) <= 9


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


def test_the_tails_are_grey_bars_outside_zero_to_one_and_named_in_a_key() -> None:
    image = _image(rewards_png(_histogram([0] * 5 + [3] * 5, below=6, above=2)))
    below = _painted(image, _column(image, -0.05, -0.1, 1.1), GREY)
    above = _painted(image, _column(image, 1.05, -0.1, 1.1), GREY)
    assert below > 0 and abs(below - 3 * above) <= 3, (below, above)
    plain = _image(rewards_png(_histogram([0] * 5 + [3] * 5)))
    grey_in = [sum(1 for x in range(image.width) if img.getpixel((x, 60)) == GREY) for img in (image, plain)]
    assert grey_in[0] > 0 and grey_in[1] == 0, grey_in  # the key's swatches, near the top, only with tails


def test_a_histogram_with_no_tasks_is_drawn_empty() -> None:
    image = _image(rewards_png(_histogram([0] * 10)))
    assert all(_painted(image, x, BLUE) == 0 for x in range(0, image.width, 7))


@pytest.mark.parametrize("repeats", [0, 4, 5, 6, 20])
def test_a_title_wider_than_the_figure_is_set_smaller_then_cut_short(repeats: int) -> None:
    """Up to about 110 characters it is set smaller (12 points down to 8); beyond, it ends in an ellipsis:
    never cut at the figure's edges."""
    image = _image(bar_chart([Bar(0, 1, 1)], "rollflow rewards: " + "a very long title " * repeats, "x", "y"))
    top = int(0.35 * DPI)
    assert any(image.getpixel((x, y)) != PAPER for x in range(image.width) for y in range(top)), "a title"
    assert all(
        image.getpixel((x, y)) == PAPER for x in (0, 1, image.width - 2, image.width - 1) for y in range(top)
    )
