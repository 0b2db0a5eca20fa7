"""Experiments built from recipes: extrapolate.py (`looplm experiment extrapolate`)."""
