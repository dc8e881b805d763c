"""Pallas GPU kernels, one per file; backends in :mod:`sagejax.backends` call them."""
