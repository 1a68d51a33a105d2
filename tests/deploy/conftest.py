"""Fixtures: each kustomize overlay rendered once per session (see `k8s_view`)."""

from __future__ import annotations

import pytest

from tests.deploy.k8s_view import OVERLAYS, Rendered, render


@pytest.fixture(scope="session")
def all_rendered() -> dict[str, Rendered]:
    """Every overlay, rendered once per session (rendering is read-only, so sharing is safe)."""
    return {name: Rendered(name, render(name)) for name in OVERLAYS}


@pytest.fixture(params=OVERLAYS)
def rendered(request: pytest.FixtureRequest, all_rendered: dict[str, Rendered]) -> Rendered:
    """Each overlay in turn."""
    return all_rendered[request.param]


@pytest.fixture
def dev(all_rendered: dict[str, Rendered]) -> Rendered:
    return all_rendered["dev"]


@pytest.fixture
def gpu(all_rendered: dict[str, Rendered]) -> Rendered:
    return all_rendered["gpu"]
