"""Deterministic synthetic voxelised 3D scenes for sparse-convolution demos and benchmarks."""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np
import torch

__all__ = ["CLASS_NAMES", "ROOM_CLASSES", "STREET_CLASSES", "furnished_room", "lidar_street", "make_scene", "voxelize"]

# Semantic labels. Street: the label is _cast's surface id (trees are modelled by their trunks,
# which are cylinders like poles). Room: rectangles are floor, ceiling, 4 walls, then furniture.
STREET_CLASSES = ("ground", "building", "vehicle", "pole/tree")
ROOM_CLASSES = ("floor", "wall", "furniture", "ceiling")
CLASS_NAMES = {"street": STREET_CLASSES, "room": ROOM_CLASSES}
_ROOM_LABEL = {"floor": 0, "wall": 1, "furniture": 2, "ceiling": 3}

_SENSOR_HEIGHT = 1.8
_RANGE_NOISE_STD = 0.02
# Clipping the noise gives tests (and users) a hard bound on how far a point can be off its surface.
_RANGE_NOISE_CLIP = 3 * _RANGE_NOISE_STD
# Fixed world extent so that a seed describes the same street whatever max_range is asked for.
_STREET_HALF_LENGTH = 150.0
# Indexed by _cast's surface id: ground (asphalt), facade (plaster), box (car paint), cylinder (metal / bark).
_REFLECTIVITY = np.array([0.2, 0.45, 0.75, 0.55])
_KINDS = ("street", "room")
_DEFAULT_VOXEL_SIZE = {"street": 0.1, "room": 0.05}
_BASE_STREET = {"num_beams": 64, "points_per_beam": 1024}
_BASE_ROOM_POINTS = 100_000


class _StreetLayout(NamedTuple):
    """Analytic street geometry; facades are x-segments of the planes y = side * half_width."""

    half_width: np.ndarray  # (2,) for sides -1, +1
    seg_start: np.ndarray  # (2, S) sorted; padded segments have start = end = +inf
    seg_end: np.ndarray  # (2, S)
    seg_height: np.ndarray  # (2, S)
    box_lo: np.ndarray  # (K, 3)
    box_hi: np.ndarray  # (K, 3)
    cyl_xy: np.ndarray  # (M, 2)
    cyl_radius: np.ndarray  # (M,)
    cyl_height: np.ndarray  # (M,)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _street_layout(seed: int) -> _StreetLayout:
    """Random street for ``seed``: facade segments with gaps, parked/driving cars, poles and trees."""
    rng = np.random.default_rng(seed)
    half_width = rng.uniform(7.0, 12.0, size=2)
    segments = []
    for _ in range(2):
        starts, ends, x = [], [], -_STREET_HALF_LENGTH + rng.uniform(0.0, 10.0)
        while x < _STREET_HALF_LENGTH:
            length = rng.uniform(8.0, 30.0)
            starts.append(x)
            ends.append(x + length)
            x += length + rng.uniform(2.0, 10.0)  # gap: alleys / driveways
        segments.append((np.array(starts), np.array(ends), rng.uniform(6.0, 25.0, size=len(starts))))
    s = max(len(seg[0]) for seg in segments)
    pad = lambda a, v: np.concatenate([a, np.full(s - len(a), v)])  # noqa: E731
    seg_start = np.stack([pad(seg[0], np.inf) for seg in segments])
    seg_end = np.stack([pad(seg[1], np.inf) for seg in segments])
    seg_height = np.stack([pad(seg[2], 0.0) for seg in segments])

    n_cars = int(rng.integers(8, 16))
    side = rng.choice([-1.0, 1.0], size=n_cars)
    lane = rng.integers(0, 2, size=n_cars)  # 0: parked at the kerb, 1: driving lane
    cy = side * np.where(lane == 0, half_width[(side > 0).astype(int)] - 3.2, 1.8)
    # Keep cars clear of the sensor so that no ray starts inside a box.
    cx = rng.uniform(5.0, 50.0, size=n_cars) * rng.choice([-1.0, 1.0], size=n_cars)
    dims = np.stack([rng.uniform(3.8, 5.0, n_cars), rng.uniform(1.7, 2.0, n_cars), rng.uniform(1.4, 1.9, n_cars)], 1)
    box_lo = np.stack([cx - dims[:, 0] / 2, cy - dims[:, 1] / 2, np.zeros(n_cars)], 1)
    box_hi = box_lo + dims

    n_cyl = int(rng.integers(12, 24))
    cside = rng.choice([0, 1], size=n_cyl)
    cyl_xy = np.stack([rng.uniform(-60.0, 60.0, n_cyl), (2 * cside - 1) * (half_width[cside] - 1.0)], 1)
    is_tree = rng.random(n_cyl) < 0.5
    cyl_radius = np.where(is_tree, rng.uniform(0.15, 0.4, n_cyl), rng.uniform(0.06, 0.12, n_cyl))
    # Taller than the sensor, so a ray can never reach a cylinder's top cap.
    cyl_height = np.where(is_tree, rng.uniform(3.0, 6.0, n_cyl), rng.uniform(4.0, 9.0, n_cyl))
    return _StreetLayout(half_width, seg_start, seg_end, seg_height, box_lo, box_hi, cyl_xy, cyl_radius, cyl_height)


def _beam_directions(num_beams: int, points_per_beam: int, rng: np.random.Generator) -> np.ndarray:
    """(num_beams * points_per_beam, 3) float64 unit ray directions of one spinning-LiDAR sweep."""
    # Like real sensors, beams are denser near the horizon where the interesting geometry is.
    t = np.linspace(0.0, 1.0, num_beams) if num_beams > 1 else np.zeros(1)
    elevation = np.radians(3.0 - 28.0 * t**1.5)
    azimuth = 2 * np.pi * np.arange(points_per_beam) / points_per_beam
    azimuth = azimuth[None, :] + rng.uniform(0, 2 * np.pi / points_per_beam, size=(num_beams, 1))
    el = np.broadcast_to(elevation[:, None], azimuth.shape)
    d = np.stack([np.cos(el) * np.cos(azimuth), np.cos(el) * np.sin(azimuth), np.sin(el)], -1)
    return d.reshape(-1, 3)


def _cast(layout: _StreetLayout, d: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Nearest hit per ray from the sensor: (R,) range (inf = miss), (R,) surface id, (R,) |cos incidence|."""
    o = np.array([0.0, 0.0, _SENSOR_HEIGHT])
    rows = np.arange(len(d))
    ts, coss = [], []
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(d[:, 2] < 0, -o[2] / d[:, 2], np.inf)
        ts.append(t)
        coss.append(np.abs(d[:, 2]))

        best_f = np.full(len(d), np.inf)
        for k, side in enumerate((-1.0, 1.0)):
            t = side * layout.half_width[k] / d[:, 1]
            t = np.where(t > 0, t, np.inf)
            x, z = t * d[:, 0], o[2] + t * d[:, 2]
            i = np.clip(np.searchsorted(layout.seg_start[k], x, side="right") - 1, 0, None)
            in_segment = (x >= layout.seg_start[k][i]) & (x < layout.seg_end[k][i])
            on_wall = in_segment & (z >= 0) & (z <= layout.seg_height[k][i])
            best_f = np.minimum(best_f, np.where(on_wall, t, np.inf))
        ts.append(best_f)
        coss.append(np.abs(d[:, 1]))

        # Slab method on (rays, boxes) arrays, one axis at a time (4x faster than a trailing axis of 3).
        # Zero direction components are nudged so that 1/d never meets a zero numerator as 0 * inf.
        inv = 1.0 / np.where(np.abs(d) < 1e-12, 1e-12, d)
        near = np.full((len(d), len(layout.box_lo)), -np.inf)
        far = np.full_like(near, np.inf)
        entry_axis = np.zeros(near.shape, dtype=np.int8)  # the entry face lies on the slab entered last
        for ax in range(3):
            ta = (layout.box_lo[:, ax] - o[ax]) * inv[:, ax : ax + 1]
            tb = (layout.box_hi[:, ax] - o[ax]) * inv[:, ax : ax + 1]
            t_in = np.minimum(ta, tb)
            later = t_in > near
            near = np.where(later, t_in, near)
            entry_axis[later] = ax
            far = np.minimum(far, np.maximum(ta, tb))
        near = np.where((near <= far) & (near > 0), near, np.inf)
        k = near.argmin(-1)
        ts.append(near[rows, k])
        coss.append(np.abs(d[rows, entry_axis[rows, k]]))

        # Vertical cylinders: quadratic in the xy-plane, entry root only (the sensor is outside all of them).
        m = -layout.cyl_xy  # sensor xy is the origin
        a = (d[:, :2] ** 2).sum(-1)[:, None]
        b = 2 * d[:, :2] @ m.T
        c = (m**2).sum(-1) - layout.cyl_radius**2
        disc = b * b - 4 * a * c
        t = (-b - np.sqrt(disc)) / (2 * a)
        z = o[2] + t * d[:, 2:3]
        t = np.where((disc >= 0) & (t > 0) & (z >= 0) & (z <= layout.cyl_height), t, np.inf)
        j = t.argmin(-1)
        t = t[rows, j]
        normal = (t[:, None] * d[:, :2] - layout.cyl_xy[j]) / layout.cyl_radius[j, None]
        ts.append(t)
        coss.append(np.abs((normal * d[:, :2]).sum(-1)))

    t_all = np.stack(ts, 1)
    surface = t_all.argmin(1)
    return t_all[rows, surface], surface, np.nan_to_num(np.stack(coss, 1)[rows, surface])


def lidar_street(
    num_beams: int = 32, points_per_beam: int = 1024, max_range: float = 60.0, seed: int = 0, with_labels: bool = False
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Ray-cast spinning-LiDAR sweep of a random street: (P, 4) float32 [x, y, z, intensity in [0, 1]],
    and with_labels the (P,) int64 class of each point (an index into STREET_CLASSES)."""
    num_beams = _check_int("num_beams", num_beams, 1)
    points_per_beam = _check_int("points_per_beam", points_per_beam, 1)
    max_range = _check_positive("max_range", max_range)
    seed = _check_int("seed", seed, 0)
    layout = _street_layout(seed)
    # Separate stream for the sensor so the world does not change with the beam count.
    rng = np.random.default_rng([seed, 1])
    d = _beam_directions(num_beams, points_per_beam, rng)
    t, surface, cos = _cast(layout, d)
    noise = np.clip(rng.normal(0.0, _RANGE_NOISE_STD, size=len(t)), -_RANGE_NOISE_CLIP, _RANGE_NOISE_CLIP)
    t = t + noise
    keep = np.isfinite(t) & (t > 0) & (t <= max_range)
    t, d, surface, cos = t[keep], d[keep], surface[keep], cos[keep]
    xyz = np.array([0.0, 0.0, _SENSOR_HEIGHT]) + t[:, None] * d
    # Lambertian-ish return: material reflectivity times incidence, with a mild range falloff.
    intensity = _REFLECTIVITY[surface] * (0.25 + 0.75 * cos) * (1.0 - 0.3 * t / max_range)
    intensity = np.clip(intensity + rng.normal(0.0, 0.02, size=len(t)), 0.0, 1.0)
    points = np.concatenate([xyz, intensity[:, None]], 1).astype(np.float32)
    return (points, surface.astype(np.int64)) if with_labels else points


def _room_rectangles(size: tuple[float, float, float], rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """Room surface rectangles: (Q, 3) corners, (Q, 3) edge u, (Q, 3) edge v, (Q,) grey level, (Q,) class."""
    lx, ly, lz = size
    e = np.eye(3)
    corners = [np.zeros(3), [0, 0, lz], np.zeros(3), [lx, 0, 0], np.zeros(3), [0, ly, 0]]
    us = [lx * e[0], lx * e[0], ly * e[1], ly * e[1], lx * e[0], lx * e[0]]
    vs = [ly * e[1], ly * e[1], lz * e[2], lz * e[2], lz * e[2], lz * e[2]]
    grey = [rng.uniform(0.3, 0.5), 0.9, *([rng.uniform(0.6, 0.85)] * 4)]  # floor, ceiling, walls
    label = [_ROOM_LABEL["floor"], _ROOM_LABEL["ceiling"], *([_ROOM_LABEL["wall"]] * 4)]
    # Nominal furniture sizes, shrunk to fit small rooms: table, bed, two cabinets, shelf.
    nominal = np.array([[1.6, 0.9, 0.75], [2.0, 1.6, 0.5], [0.6, 0.5, 1.8], [1.0, 0.5, 0.9], [0.4, 1.2, 2.0]])
    for dims in np.minimum(nominal, 0.45 * np.array(size)):
        lo = rng.uniform(0.0, 1.0, 2) * (np.array([lx, ly]) - dims[:2])
        lo = np.array([lo[0], lo[1], 0.0])
        hi, g = lo + dims, rng.uniform(0.1, 0.9)
        dx, dy, dz = dims[0] * e[0], dims[1] * e[1], dims[2] * e[2]
        # Top and four sides; the bottom rests on the floor and is never seen.
        corners += [lo + dz, lo, lo, [hi[0], lo[1], 0], [lo[0], hi[1], 0]]
        us += [dx, dx, dy, dy, dx]
        vs += [dy, dz, dz, dz, dz]
        grey += [g] * 5
        label += [_ROOM_LABEL["furniture"]] * 5
    return np.array(corners, float), np.array(us), np.array(vs), np.array(grey), np.array(label, np.int64)


def furnished_room(
    num_points: int = 100_000,
    size: tuple[float, float, float] = (6.0, 5.0, 3.0),
    seed: int = 0,
    with_labels: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Points on the surfaces of a furnished box room: (P, 4) float32 [x, y, z, grey in [0, 1]],
    and with_labels the (P,) int64 class of each point (an index into ROOM_CLASSES)."""
    num_points = _check_int("num_points", num_points, 0)
    if not isinstance(size, (tuple, list, np.ndarray)) or len(size) != 3:
        raise ValueError(f"size must be three positive numbers (x, y, z), got {size!r}")
    size = tuple(_check_positive("size", s) for s in size)
    seed = _check_int("seed", seed, 0)
    rng = np.random.default_rng(seed)
    corners, us, vs, grey, label = _room_rectangles(size, rng)
    area = np.linalg.norm(np.cross(us, vs), axis=1)
    idx = np.repeat(np.arange(len(area)), rng.multinomial(num_points, area / area.sum()))
    ab = rng.random((num_points, 2))
    xyz = corners[idx] + ab[:, :1] * us[idx] + ab[:, 1:] * vs[idx]
    xyz += rng.normal(0.0, 0.003, size=xyz.shape)  # depth-sensor noise
    colour = np.clip(grey[idx] + rng.normal(0.0, 0.03, size=num_points), 0.0, 1.0)
    points = np.concatenate([xyz, colour[:, None]], 1).astype(np.float32)
    return (points, label[idx]) if with_labels else points


def voxelize(
    points: np.ndarray, voxel_size: float, batch_index: int = 0, labels: np.ndarray | None = None
) -> tuple[torch.Tensor, ...]:
    """(P, D>=3) points -> unique coords (N, 4) int32 [b,x,y,z], feats (N, D) float32 mean [offset in [0,1), cols 3:]

    labels: (P,) non-negative ints -> also (N,) int64, each voxel's most frequent point label
    (ties go to the smallest label).
    """
    if not isinstance(points, np.ndarray) or points.ndim != 2 or points.shape[1] < 3:
        raise ValueError(f"points must be a (P, >=3) numpy array, got {getattr(points, 'shape', type(points))}")
    if not np.issubdtype(points.dtype, np.floating):
        raise ValueError(f"points must have a floating dtype, got {points.dtype}")
    if not np.isfinite(points).all():
        raise ValueError("points must be finite (found NaN or inf)")
    voxel_size = _check_positive("voxel_size", voxel_size)
    batch_index = _check_int("batch_index", batch_index, 0)
    if labels is not None:
        labels = np.asarray(labels)
        if labels.shape != (len(points),) or not np.issubdtype(labels.dtype, np.integer) or (labels < 0).any():
            raise ValueError(
                f"labels must be ({len(points)},) non-negative integers (one per point), got "
                f"shape {labels.shape} dtype {labels.dtype}"
            )
    if batch_index > np.iinfo(np.int32).max:
        raise ValueError(f"batch_index must fit in int32, got {batch_index}")

    q = points[:, :3].astype(np.float64) / voxel_size
    cell = np.floor(q)
    lim = np.iinfo(np.int32)
    if cell.size and (cell.min() < lim.min or cell.max() > lim.max):
        raise ValueError(f"voxel_size {voxel_size} is too small: voxel coordinates overflow int32")
    cell = cell.astype(np.int64)
    # One int64 key per voxel makes np.unique 1-D, which is much faster than axis=0 on rows.
    lo = cell.min(0) if cell.size else np.zeros(3, np.int64)
    ext = (cell.max(0) - lo + 1) if cell.size else np.ones(3, np.int64)
    if float(ext[0]) * float(ext[1]) * float(ext[2]) < 2.0**62:
        rel = cell - lo
        key = (rel[:, 0] * ext[1] + rel[:, 1]) * ext[2] + rel[:, 2]
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        uniq = cell[first]
    else:
        uniq, inverse = np.unique(cell, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    n = len(uniq)

    counts = np.bincount(inverse, minlength=n).astype(np.float64)
    values = np.concatenate([q - cell, points[:, 3:].astype(np.float64)], 1)
    feats = np.stack([np.bincount(inverse, weights=col, minlength=n) for col in values.T], 1) if n else values[:0]
    feats = (feats / np.maximum(counts, 1)[:, None]).astype(np.float32)
    # q - floor(q) can round up to exactly 1.0 for tiny negative q; keep the documented half-open range.
    np.minimum(feats[:, :3], np.nextafter(np.float32(1), np.float32(0)), out=feats[:, :3])
    coords = np.concatenate([np.full((n, 1), batch_index, np.int64), uniq], 1).astype(np.int32)
    result = (torch.from_numpy(np.ascontiguousarray(coords)), torch.from_numpy(np.ascontiguousarray(feats)))
    return result if labels is None else (*result, torch.from_numpy(_majority(inverse, labels, n)))


def _majority(inverse: np.ndarray, labels: np.ndarray, n: int) -> np.ndarray:
    """(N,) int64 most frequent label per voxel; argmax picks the smallest label on a tie."""
    num_labels = int(labels.max()) + 1 if len(labels) else 1
    votes = np.bincount(inverse * num_labels + labels, minlength=n * num_labels).reshape(n, num_labels)
    return votes.argmax(1).astype(np.int64)


def make_scene(
    kind: str = "street",
    voxel_size: float | None = None,
    batch_size: int = 1,
    seed: int = 0,
    scale: float = 1.0,
    with_labels: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Batch of voxelised scenes (seeds seed, seed+1, ...): coords (N, 4) int32 [b, x, y, z], feats (N, 4) float32,
    and with_labels (N,) int64 voxel classes (majority of the points; names in CLASS_NAMES[kind])."""
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {list(_KINDS)}, got {kind!r}")
    voxel_size = _DEFAULT_VOXEL_SIZE[kind] if voxel_size is None else _check_positive("voxel_size", voxel_size)
    batch_size = _check_int("batch_size", batch_size, 1)
    seed = _check_int("seed", seed, 0)
    scale = _check_positive("scale", scale)
    parts = []
    for b in range(batch_size):
        if kind == "street":
            ppb = max(1, round(_BASE_STREET["points_per_beam"] * scale))
            pts, labels = lidar_street(_BASE_STREET["num_beams"], ppb, seed=seed + b, with_labels=True)
        else:
            pts, labels = furnished_room(max(1, round(_BASE_ROOM_POINTS * scale)), seed=seed + b, with_labels=True)
        parts.append(voxelize(pts, voxel_size, batch_index=b, labels=labels if with_labels else None))
    return tuple(torch.cat(column) for column in zip(*parts))
