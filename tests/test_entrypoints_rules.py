"""Rules of the services' entry points (services/*/__main__.py, bootstrap's `service_main`)
that the differential review found broken: a refusal found after the config was read names
what the user typed, the flag where one set the value, as every refusal of the config does."""

from __future__ import annotations

import importlib
import json
import logging
import os
import socket
import sys
import tempfile

import pytest

from services.common import bootstrap


def call_main(service: str, argv: list[str], env: dict[str, str], monkeypatch):
    """(exit status, stderr lines) of `services.<service>.__main__.main(argv)` in `env`
    (no other TIERCACHE_ variable)."""
    mod = importlib.import_module(f"services.{service}.__main__")
    for k in list(os.environ):
        if k.startswith("TIERCACHE_"):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(bootstrap.faulthandler, "enable", lambda *a, **k: None)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    with tempfile.TemporaryFile("w+") as err:
        real, sys.stderr = sys.stderr, err
        try:
            rc = mod.main(argv)
        finally:
            sys.stderr = real
            root.handlers[:] = saved[0]
            root.setLevel(saved[1])
        err.seek(0)
        return rc, err.read().splitlines()


@pytest.fixture()
def busy():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def error_line(lines: list[str]) -> str:
    errors = [j["msg"] for j in map(json.loads, (ln for ln in lines if ln.startswith("{")))
              if j["level"] == "ERROR"]
    assert len(errors) == 1, lines
    return errors[0]


@pytest.mark.parametrize("service", ["prefix", "semantic", "orchestrator"])
@pytest.mark.parametrize("setting", ["address", "metrics_port"])
def test_a_port_that_cannot_be_bound_is_named_as_given(service, setting, busy, tmp_path,
                                                        monkeypatch):
    """`--address` of a busy port was blamed on TIERCACHE_<SVC>_ADDRESS, which was never set
    (semantic also said "BindError: "); given by the variable, the variable is named."""
    var = f"TIERCACHE_{service.upper()}_{setting.upper()}"
    flag = "--" + setting.replace("_", "-")
    value = f"127.0.0.1:{busy}" if setting == "address" else str(busy)
    other = ["--metrics-port", "-1"] if setting == "address" else ["--address", "127.0.0.1:0"]
    env = {"HOME": str(tmp_path)}
    rc, lines = call_main(service, [flag, value, *other], env, monkeypatch)
    assert rc == 2
    assert error_line(lines).startswith(f"bad configuration: {flag} (env {var}): cannot listen")
    rc, lines = call_main(service, other, {**env, var: value}, monkeypatch)
    assert rc == 2
    assert error_line(lines).startswith(f"bad configuration: {var}: cannot listen")


def test_a_cuda_device_torch_cannot_see_is_named_as_given(monkeypatch, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["--address", "127.0.0.1:0", "--metrics-port", "-1"]
    rc, lines = call_main("kvpool", ["--device", "cuda:0", *argv], {"HOME": str(tmp_path)},
                         monkeypatch)
    assert rc == 2
    assert error_line(lines).startswith(
        "bad configuration: --device (env TIERCACHE_KVPOOL_DEVICE): 'cuda:0': this torch")
    rc, lines = call_main("kvpool", argv, {"HOME": str(tmp_path),
                                           "TIERCACHE_KVPOOL_DEVICE": "cuda"}, monkeypatch)
    assert rc == 2
    assert error_line(lines).startswith(
        "bad configuration: TIERCACHE_KVPOOL_DEVICE: 'cuda': this torch")
