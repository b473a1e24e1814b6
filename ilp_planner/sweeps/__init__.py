"""Batch solves: sweep points, the driver and its worker backends."""
