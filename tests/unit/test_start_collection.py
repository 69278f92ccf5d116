"""Garbage collection during start-up: off while the modules import and the model loads
(each full collection walks every object made so far), back on, with what start-up made
frozen out of it, before the server serves; back on too when the start fails."""

import gc

import pytest
from support import free_port

from mlx_server import cli
from mlx_server.boot import start as boot_start


@pytest.fixture
def collection_restored():
    yield
    gc.unfreeze()
    gc.enable()


def test_off_while_loading_and_on_with_start_up_frozen_while_serving(
    monkeypatch, collection_restored
):
    seen = {}

    def build(settings, group=None):
        seen["loading"] = gc.isenabled()
        return object(), object()

    def serve(app, engine, sock, *args):
        seen["serving"] = gc.isenabled()
        seen["frozen"] = gc.get_freeze_count() > 0
        sock.close()

    monkeypatch.setattr(boot_start, "build", build)
    monkeypatch.setattr(boot_start, "serve", serve)
    assert cli.main(["-m", "some/model", "--port", str(free_port())]) == 0
    assert seen == {"loading": False, "serving": True, "frozen": True}
    assert gc.isenabled()


def test_on_again_after_a_failed_start(monkeypatch, collection_restored):
    def build(settings, group=None):
        assert not gc.isenabled()
        raise RuntimeError("no such model")

    monkeypatch.setattr(boot_start, "build", build)
    assert cli.main(["-m", "some/model", "--port", str(free_port())]) == 1
    assert gc.isenabled()
