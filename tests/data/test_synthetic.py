import math
from collections import defaultdict

import numpy as np
import pytest
import torch

from sparseconv.data.synthetic import (
    _RANGE_NOISE_CLIP,
    _SENSOR_HEIGHT,
    CLASS_NAMES,
    ROOM_CLASSES,
    STREET_CLASSES,
    _street_layout,
    furnished_room,
    lidar_street,
    make_scene,
    voxelize,
)


@pytest.fixture(scope="module")
def street_scene():
    return make_scene("street", batch_size=2, seed=0)


@pytest.fixture(scope="module")
def room_scene():
    return make_scene("room", batch_size=2, seed=0)


@pytest.mark.parametrize("make", [lambda s: lidar_street(seed=s), lambda s: furnished_room(20_000, seed=s)])
def test_generators_deterministic_per_seed(make):
    a, b, c = make(3), make(3), make(4)
    assert a.dtype == np.float32 and a.ndim == 2 and a.shape[1] == 4
    np.testing.assert_array_equal(a, b)
    assert a.shape != c.shape or not np.array_equal(a, c)
    assert np.isfinite(a).all()
    assert a[:, 3].min() >= 0.0 and a[:, 3].max() <= 1.0


@pytest.mark.parametrize("kind", ["street", "room"])
def test_make_scene_deterministic_per_seed(kind):
    c1, f1 = make_scene(kind, seed=5, scale=0.25)
    c2, f2 = make_scene(kind, seed=5, scale=0.25)
    c3, _ = make_scene(kind, seed=6, scale=0.25)
    assert torch.equal(c1, c2) and torch.equal(f1, f2)
    assert c1.shape != c3.shape or not torch.equal(c1, c3)


@pytest.mark.parametrize("scene", ["street_scene", "room_scene"])
def test_make_scene_batch_layout(scene, request):
    coords, feats = request.getfixturevalue(scene)
    assert coords.dtype == torch.int32 and feats.dtype == torch.float32
    assert coords.ndim == 2 and coords.shape[1] == 4
    assert feats.shape == (coords.shape[0], 4)
    assert torch.unique(coords, dim=0).shape[0] == coords.shape[0]
    batch = coords[:, 0]
    # Scenes are concatenated in batch order, and every batch index is present.
    assert torch.all(batch[1:] >= batch[:-1])
    assert set(batch.tolist()) == {0, 1}
    assert torch.isfinite(feats).all()
    assert feats[:, :3].min() >= 0.0 and feats[:, :3].max() < 1.0
    assert feats[:, 3].min() >= 0.0 and feats[:, 3].max() <= 1.0


def test_make_scene_batch_item_equals_single_scene(street_scene):
    coords, feats = street_scene
    single_c, single_f = make_scene("street", seed=1)
    second = coords[:, 0] == 1
    assert torch.equal(coords[second, 1:], single_c[:, 1:])
    assert torch.equal(feats[second], single_f)


@pytest.mark.parametrize(("scene", "low", "high"), [("street_scene", 20_000, 60_000), ("room_scene", 30_000, 80_000)])
def test_voxel_counts_at_unit_scale(scene, low, high, request):
    coords, _ = request.getfixturevalue(scene)
    for b in (0, 1):
        assert low <= int((coords[:, 0] == b).sum()) <= high


def test_scale_grows_scene():
    small, _ = make_scene("room", scale=0.25)
    large, _ = make_scene("room", scale=1.0)
    assert small.shape[0] < large.shape[0]


def _reference_voxelize(points, voxel_size, batch_index):
    cells = defaultdict(list)
    for p in points.astype(np.float64):
        q = p[:3] / voxel_size
        cell = tuple(int(math.floor(v)) for v in q)
        cells[cell].append(np.concatenate([q - np.floor(q), p[3:]]))
    return {(batch_index, *cell): np.mean(vals, axis=0) for cell, vals in cells.items()}


def test_voxelize_matches_bruteforce_reference():
    # Fresh entropy every run, reported on failure so that a counterexample can be replayed.
    entropy = np.random.SeedSequence().entropy
    rng = np.random.default_rng(entropy)
    for _ in range(20):
        n, dims = int(rng.integers(1, 400)), int(rng.integers(3, 7))
        voxel_size = float(rng.uniform(0.05, 1.0))
        # A small extent relative to the voxel size forces many points per voxel; negatives must stay signed.
        points = rng.uniform(-2.0, 2.0, size=(n, dims)).astype(rng.choice([np.float32, np.float64]))
        batch_index = int(rng.integers(0, 5))
        coords, feats = voxelize(points, voxel_size, batch_index=batch_index)
        ref = _reference_voxelize(points, voxel_size, batch_index)
        msg = f"entropy={entropy}"
        assert coords.dtype == torch.int32 and feats.dtype == torch.float32, msg
        assert feats.shape == (len(ref), dims), msg
        got = {tuple(c): f for c, f in zip(coords.tolist(), feats.numpy())}
        assert got.keys() == ref.keys(), msg
        for key, want in ref.items():
            np.testing.assert_allclose(got[key], want, rtol=1e-5, atol=1e-5, err_msg=msg)


def test_voxelize_offsets_stay_below_one_for_tiny_negative_coordinates():
    points = np.array([[-1e-20, -1e-300, 0.0, 0.5], [-1e-9, 2.0, -0.1, 0.25]])
    coords, feats = voxelize(points, 0.1)
    assert coords[:, 1:].min() < 0
    assert feats[:, :3].max() < 1.0 and feats[:, :3].min() >= 0.0


def test_voxelize_empty_input():
    coords, feats = voxelize(np.zeros((0, 4), np.float32), 0.1)
    assert coords.shape == (0, 4) and coords.dtype == torch.int32
    assert feats.shape == (0, 4) and feats.dtype == torch.float32


def _distance_to_street(points, layout):
    """(P,) distance from each point to the nearest analytic surface of the street."""
    p = points[:, :3].astype(np.float64)
    x, y, z = p[:, 0:1], p[:, 1:2], p[:, 2:3]
    dists = [np.abs(p[:, 2])]
    for k, side in enumerate((-1.0, 1.0)):
        finite = np.isfinite(layout.seg_start[k])
        start, end, height = layout.seg_start[k][finite], layout.seg_end[k][finite], layout.seg_height[k][finite]
        dx = np.maximum(np.maximum(start - x, x - end), 0.0)
        dz = np.maximum(np.maximum(-z, z - height), 0.0)
        dists.append(np.sqrt(dx**2 + (y - side * layout.half_width[k]) ** 2 + dz**2).min(1))
    rel_lo, rel_hi = p[:, None, :] - layout.box_lo, layout.box_hi - p[:, None, :]
    outside = np.linalg.norm(np.maximum(np.maximum(-rel_lo, -rel_hi), 0.0), axis=-1)
    inside = np.minimum(rel_lo, rel_hi).min(-1)
    dists.append(np.where(inside > 0, inside, outside).min(1))
    radial = np.abs(np.linalg.norm(p[:, None, :2] - layout.cyl_xy, axis=-1) - layout.cyl_radius)
    dz = np.maximum(np.maximum(-z, z - layout.cyl_height), 0.0)
    dists.append(np.sqrt(radial**2 + dz**2).min(1))
    return np.stack(dists, 1)


def test_lidar_points_lie_on_scene_surfaces():
    max_range = 40.0
    points = lidar_street(num_beams=16, points_per_beam=512, max_range=max_range, seed=7)
    assert len(points) > 0.5 * 16 * 512
    sensor = np.array([0.0, 0.0, _SENSOR_HEIGHT])
    ranges = np.linalg.norm(points[:, :3].astype(np.float64) - sensor, axis=1)
    assert ranges.max() <= max_range + 1e-3
    assert points[:, 2].min() >= -_RANGE_NOISE_CLIP - 1e-4
    dists = _distance_to_street(points, _street_layout(7))
    assert dists.min(1).max() <= _RANGE_NOISE_CLIP + 1e-3
    # Every surface kind is actually seen: ground, both facades, cars, poles/trees.
    assert set(np.unique(dists.argmin(1)).tolist()) == {0, 1, 2, 3, 4}


def test_room_points_inside_room():
    size = (4.0, 3.0, 2.5)
    points = furnished_room(5_000, size=size, seed=2)
    assert points.shape == (5_000, 4)
    assert np.all(points[:, :3] > -0.05) and np.all(points[:, :3] < np.array(size) + 0.05)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: voxelize(np.zeros((4, 2)), 0.1), "points"),
        (lambda: voxelize(np.zeros(4), 0.1), "points"),
        (lambda: voxelize([[0.0, 0.0, 0.0]], 0.1), "points"),
        (lambda: voxelize(np.zeros((4, 4), np.int64), 0.1), "points"),
        (lambda: voxelize(np.array([[0.0, np.nan, 0.0]]), 0.1), "points"),
        (lambda: voxelize(np.array([[0.0, np.inf, 0.0]]), 0.1), "points"),
        (lambda: voxelize(np.zeros((4, 4)), 0.0), "voxel_size"),
        (lambda: voxelize(np.zeros((4, 4)), -1.0), "voxel_size"),
        (lambda: voxelize(np.zeros((4, 4)), float("nan")), "voxel_size"),
        (lambda: voxelize(np.full((4, 4), 1e6), 1e-9), "voxel_size"),
        (lambda: voxelize(np.zeros((4, 4)), 0.1, batch_index=-1), "batch_index"),
        (lambda: voxelize(np.zeros((4, 4)), 0.1, batch_index=0.5), "batch_index"),
        (lambda: make_scene("forest"), "kind"),
        (lambda: make_scene("street", voxel_size=0.0), "voxel_size"),
        (lambda: make_scene("room", batch_size=0), "batch_size"),
        (lambda: make_scene("room", scale=0.0), "scale"),
        (lambda: make_scene("room", seed=-1), "seed"),
        (lambda: lidar_street(num_beams=0), "num_beams"),
        (lambda: lidar_street(points_per_beam=0), "points_per_beam"),
        (lambda: lidar_street(max_range=-5.0), "max_range"),
        (lambda: furnished_room(num_points=-1), "num_points"),
        (lambda: furnished_room(size=(1.0, 2.0)), "size"),
        (lambda: furnished_room(size=(1.0, 0.0, 2.0)), "size"),
    ],
)
def test_bad_arguments_raise_value_error_naming_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_bad_kind_lists_valid_kinds():
    with pytest.raises(ValueError, match=r"street.*room"):
        make_scene("forest")


# --- semantic labels ---------------------------------------------------------------------------


def test_street_labels_name_the_surface_each_point_lies_on():
    points, labels = lidar_street(num_beams=16, points_per_beam=512, seed=5, with_labels=True)
    np.testing.assert_array_equal(points, lidar_street(num_beams=16, points_per_beam=512, seed=5))
    assert labels.shape == (len(points),) and labels.dtype == np.int64
    assert set(np.unique(labels).tolist()) == set(range(len(STREET_CLASSES)))
    # Distance columns: ground, two facades, cars, cylinders -> classes ground, building, vehicle, pole/tree.
    column_class = np.array([0, 1, 1, 2, 3])
    dists = _distance_to_street(points, _street_layout(5))
    own = np.where(column_class[None, :] == labels[:, None], dists, np.inf).min(1)
    assert own.max() <= _RANGE_NOISE_CLIP + 1e-3


def test_room_labels_follow_the_room_geometry():
    size = (5.0, 4.0, 2.5)
    points, labels = furnished_room(20_000, size=size, seed=4, with_labels=True)
    np.testing.assert_array_equal(points, furnished_room(20_000, size=size, seed=4))
    assert set(np.unique(labels).tolist()) == set(range(len(ROOM_CLASSES)))
    x, y, z = points[:, 0], points[:, 1], points[:, 2]
    name = np.array(ROOM_CLASSES)[labels]
    noise = 0.02
    assert np.all(np.abs(z[name == "floor"]) < noise)
    assert np.all(np.abs(z[name == "ceiling"] - size[2]) < noise)
    to_wall = np.minimum.reduce([np.abs(x), np.abs(x - size[0]), np.abs(y), np.abs(y - size[1])])
    assert np.all(to_wall[name == "wall"] < noise)
    # Furniture stands on the floor, below the ceiling, and is not only thin walls.
    furniture = name == "furniture"
    assert z[furniture].min() > -noise and z[furniture].max() < size[2] - 0.2
    assert np.median(to_wall[furniture]) > 0.1


def test_voxel_labels_are_the_majority_of_their_points_with_ties_to_the_smallest():
    rng = np.random.default_rng(np.random.SeedSequence().entropy)
    points = rng.uniform(-1.0, 1.0, size=(500, 4))
    labels = rng.integers(0, 4, size=500)
    coords, feats, voxel_labels = voxelize(points, 0.5, batch_index=2, labels=labels)
    plain_coords, plain_feats = voxelize(points, 0.5, batch_index=2)
    assert torch.equal(coords, plain_coords) and torch.equal(feats, plain_feats)
    assert voxel_labels.dtype == torch.int64 and voxel_labels.shape == (len(coords),)
    votes = defaultdict(lambda: np.zeros(4, int))
    for p, label in zip(points, labels):
        votes[(2, *(int(math.floor(v / 0.5)) for v in p[:3]))][label] += 1
    for c, label in zip(coords.tolist(), voxel_labels.tolist()):
        assert label == int(np.argmax(votes[tuple(c)]))  # argmax: first (smallest) of the tied
    with pytest.raises(ValueError, match="labels must be"):
        voxelize(points, 0.5, labels=labels[:-1])
    with pytest.raises(ValueError, match="labels must be"):
        voxelize(points, 0.5, labels=-labels - 1)


@pytest.mark.parametrize("kind", ["street", "room"])
def test_make_scene_with_labels_adds_a_label_per_voxel_and_keeps_the_rest(kind):
    coords, feats, labels = make_scene(kind, batch_size=2, seed=3, scale=0.2, with_labels=True)
    plain = make_scene(kind, batch_size=2, seed=3, scale=0.2)
    assert len(plain) == 2 and torch.equal(coords, plain[0]) and torch.equal(feats, plain[1])
    assert labels.shape == (len(coords),) and labels.dtype == torch.int64
    assert set(labels.unique().tolist()) == set(range(len(CLASS_NAMES[kind])))
