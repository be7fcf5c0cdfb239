"""Fixtures: the tiny checkpoint, a colocated reference engine, a cluster of real daemons."""

from tests.cluster import cluster, colocated, tiny_models, tok  # noqa: F401 (pytest fixtures)
