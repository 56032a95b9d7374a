"""Synthetic voxelised 3D scenes, with semantic labels, for demos, tests and benchmarks."""

from sparseconv.data.synthetic import (
    CLASS_NAMES,
    ROOM_CLASSES,
    STREET_CLASSES,
    furnished_room,
    lidar_street,
    make_scene,
    voxelize,
)

__all__ = ["CLASS_NAMES", "ROOM_CLASSES", "STREET_CLASSES", "furnished_room", "lidar_street", "make_scene", "voxelize"]
