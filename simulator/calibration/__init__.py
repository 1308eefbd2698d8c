"""Shipped calibration files (eta efficiency factors and fixed costs) as package data."""
