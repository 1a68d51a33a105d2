"""Fixtures for cache-assisted generation tests: the kvpool tests' tiny model, engines, SmolLM2."""

from tests.kvpool.conftest import make_engine, smollm2, tiny_model  # noqa: F401 - fixtures
