"""Engines: the interface (:mod:`workers.engines.base`) and its implementations."""
