"""Tests for gyre.obs.timeline: PNG output, segment merging, input validation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gyre.obs.timeline import STATES, Segment, merge_segments, write_role_timeline

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LANES = ("cell 0 (core)", "cell 1", "pool")


def _segments() -> list[Segment]:
    return [
        Segment("cell 0 (core)", 0.0, 3600.0, "training"),
        Segment("cell 0 (core)", 3600.0, 5400.0, "training_wait"),
        Segment("cell 1", 0.0, 1800.0, "rollout", 0.9),
        Segment("cell 1", 1800.0, 2400.0, "rollout", 0.1),
        Segment("cell 1", 2400.0, 2700.0, "to_training"),
        Segment("cell 1", 2700.0, 4500.0, "training"),
        Segment("cell 1", 4500.0, 4800.0, "to_rollout"),
        Segment("cell 1", 4800.0, 7200.0, "rollout"),
        Segment("pool", 0.0, 7200.0, "rollout", 0.6),
    ]


def _assert_png(path: Path) -> None:
    import matplotlib.image

    data = path.read_bytes()
    assert len(data) > 0
    assert data[:8] == PNG_SIGNATURE
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[2] in (3, 4)
    assert img.shape[1] == 12 * 110  # 12 in wide at dpi 110
    assert img.shape[0] >= 300


def test_writes_valid_png_with_both_panels(tmp_path: Path) -> None:
    out = tmp_path / "timeline.png"
    write_role_timeline(
        out,
        _segments(),
        LANES,
        title="role timeline",
        waterlevel=[(0.0, 10.0), (1800.0, 30.0), (5000.0, 20.0)],
        capacity=[(0.0, 40.0), (2400.0, 20.0), (4800.0, 40.0)],
        step_ends_s=[3600.0, 5400.0],
    )
    _assert_png(out)


def test_writes_valid_png_lanes_only_and_empty(tmp_path: Path) -> None:
    out = tmp_path / "lanes_only.png"
    write_role_timeline(str(out), _segments(), LANES)
    _assert_png(out)
    empty = tmp_path / "empty.png"
    write_role_timeline(empty, [], ["cell 0"])
    assert empty.read_bytes()[:8] == PNG_SIGNATURE


def test_repeated_calls_leave_no_pyplot_figures(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    before = set(plt.get_fignums())
    for i in range(5):
        write_role_timeline(tmp_path / f"t{i}.png", _segments(), LANES, step_ends_s=[3600.0])
    assert set(plt.get_fignums()) == before


def test_import_does_not_import_matplotlib() -> None:
    code = "import sys, gyre.obs.timeline; assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_merge_segments_exact() -> None:
    segs = [
        # cell 1, deliberately out of order: three touching rollouts whose occupancy rounds to 0.5,
        # then a rollout at 0.9 (different bucket), a training, and a rollout at 0.9 again.
        Segment("cell 1", 10.0, 20.0, "rollout", 0.46),
        Segment("cell 1", 0.0, 10.0, "rollout", 0.5),
        Segment("cell 1", 20.0, 25.0, "rollout", 0.54),
        Segment("cell 1", 25.0, 30.0, "rollout", 0.9),
        Segment("cell 1", 30.0, 40.0, "training"),
        Segment("cell 1", 40.0, 50.0, "rollout", 0.9),
        # cell 0: touching and overlapping training merge; a gap splits; occupancy on training is ignored.
        Segment("cell 0", 0.0, 5.0, "training"),
        Segment("cell 0", 5.0, 8.0, "training", 0.3),
        Segment("cell 0", 7.0, 9.0, "training"),
        Segment("cell 0", 12.0, 15.0, "training"),
        # float noise below the tolerance still counts as touching
        Segment("pool", 0.0, 1.0, "rollout"),
        Segment("pool", 1.0 + 1e-9, 2.0, "rollout"),
    ]
    assert merge_segments(segs) == [
        Segment("cell 1", 0.0, 25.0, "rollout", 0.5),
        Segment("cell 1", 25.0, 30.0, "rollout", 0.9),
        Segment("cell 1", 30.0, 40.0, "training", None),
        Segment("cell 1", 40.0, 50.0, "rollout", 0.9),
        Segment("cell 0", 0.0, 9.0, "training", None),
        Segment("cell 0", 12.0, 15.0, "training", None),
        Segment("pool", 0.0, 2.0, "rollout", None),
    ]


def test_merge_reduces_many_touching_segments() -> None:
    segs = [Segment("cell 2", float(i), float(i + 1), "rollout", 0.71 + (i % 3) * 0.01) for i in range(1000)]
    assert merge_segments(segs) == [Segment("cell 2", 0.0, 1000.0, "rollout", 0.7)]
    assert merge_segments([]) == []


def test_unknown_state_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'sleeping'") as err:
        write_role_timeline(tmp_path / "x.png", [Segment("cell 1", 0.0, 1.0, "sleeping")], LANES)
    for state in STATES:
        assert state in str(err.value)
    assert not (tmp_path / "x.png").exists()


def test_unknown_lane_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'cell 9'") as err:
        write_role_timeline(tmp_path / "x.png", [Segment("cell 9", 0.0, 1.0, "training")], LANES)
    for lane in LANES:
        assert lane in str(err.value)
    assert not (tmp_path / "x.png").exists()


def test_end_before_start_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="end_s"):
        write_role_timeline(tmp_path / "x.png", [Segment("cell 1", 5.0, 4.0, "training")], LANES)


@pytest.mark.parametrize(
    ("segments", "lanes", "match"),
    [
        ([Segment("cell 1", 0.0, 1.0, "rollout", 1.5)], LANES, "occupancy"),
        ([Segment("cell 1", 0.0, float("nan"), "rollout")], LANES, "finite"),
        ([], (), "at least one lane"),
        ([], ("cell 1", "cell 1"), "unique"),
    ],
)
def test_other_invalid_input_raises(
    tmp_path: Path, segments: list[Segment], lanes: tuple[str, ...], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        write_role_timeline(tmp_path / "x.png", segments, lanes)


def test_stacked_timelines_draw_several_runs_on_one_time_axis(tmp_path):
    from gyre.obs.timeline import write_stacked_timelines

    out = tmp_path / "stacked.png"
    write_stacked_timelines(out, [("a", _segments(), LANES, [60.0]), ("b", _segments(), LANES, [])], title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="at least one"):
        write_stacked_timelines(tmp_path / "none.png", [])
    with pytest.raises(ValueError):
        write_stacked_timelines(tmp_path / "bad.png", [("a", [Segment("nope", 0, 1, "rollout")], LANES, [])])
