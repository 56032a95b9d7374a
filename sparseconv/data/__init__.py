"""Synthetic voxelised 3D scenes for demos and benchmarks."""

from sparseconv.data.synthetic import furnished_room, lidar_street, make_scene, voxelize

__all__ = ["furnished_room", "lidar_street", "make_scene", "voxelize"]
