"""Helpers the tests share: process launchers, small models, float64 oracles, doubles."""
