"""``flower.Client(module, device_runtime="iree")``: a user's own ClientApp running the
round's client work (and its evaluation) as IREE modules, against the same Client on
jax, on the messages of Flower's JAX template switched to fcir (docs/flower_app.md),
delivered in this process (tests/flowerlib/inprocess.py)."""

from __future__ import annotations

import types

import numpy as np
import pytest
from flowerlib import inprocess, jax_template

pytestmark = pytest.mark.slow  # docs/contributing.md: IREE compiles, as test_flower_iree.py

pytest.importorskip("flwr", reason="the Flower tests need flwr (pip install 'fcir[flower]')")
pytest.importorskip("iree.compiler", reason="needs iree-base-compiler (pip install 'fcir[iree]')")
pytest.importorskip("iree.runtime", reason="needs iree-base-runtime (pip install 'fcir[iree]')")

from fcir.interpreters import flower  # noqa: E402
from flwr.app import Context, RecordDict  # noqa: E402


@pytest.fixture(scope="module")
def template_round():
    """One round of the switched template with jax clients: the module, its evaluation,
    and every (message, reply) the nodes exchanged (train and evaluate)."""
    module, evaluation = jax_template.capture(), jax_template.capture(split=2)
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0  # as flwr-serverapp
    nodes = {101 + i: {"partition-id": i, "num-partitions": jax_template.NODES}
             for i in range(jax_template.NODES)}
    client = jax_template.fcir_client(module, evaluation)
    grid = inprocess.Grid(types.SimpleNamespace(client=types.SimpleNamespace(app=client)), nodes)
    config = {**jax_template.RUN_CONFIG, "num-server-rounds": 1}
    for c in grid.contexts.values():
        c.run_config = config
    server = jax_template.template_server(
        lambda **kw: flower.Strategy(module, evaluation=evaluation, **kw)
    )
    server(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config))
    return module, evaluation, grid


def _reply_of(client, msg, partition: int):
    x, y, x_test, y_test = jax_template.load_data(partition)
    if msg.metadata.message_type.startswith("evaluate"):
        return client.evaluate(msg, x_test, y_test)
    return client.train(msg, x, y)


def _no_jax(monkeypatch):
    """Makes every way the Client could run jax code raise."""
    import jax

    def refuse(*a, **k):
        raise AssertionError("jax ran in the client step")

    for where, name in ((jax, "jit"), (jax.export, "deserialize"), (jax, "device_put")):
        monkeypatch.setattr(where, name, refuse)


def test_the_iree_client_replies_as_the_jax_client_without_running_jax(template_round, monkeypatch):
    """Each train and evaluate reply of the IREE Client equals the jax Client's (the same
    arrays to rtol 1e-5 / atol 1e-6, as test_flower_iree.py holds the IREE app to the jax
    app; the same metrics keys and num-examples), with jax made unusable while it runs;
    the jax Client fails the same way, so the check would catch a jax call."""
    from fcir.interpreters.flower.app import runtime

    module, evaluation, grid = template_round
    kinds = sorted({m.metadata.message_type for m, _ in grid.exchanged})
    assert kinds == ["evaluate", "train"], kinds
    iree = flower.Client(module, evaluation=evaluation, device_runtime="iree")
    step = iree.parts.exchange["client"]
    assert "artifact" not in step and step["iree"]["modules"]["llvm-cpu"]["verified"].startswith("ran and matched")
    jax_client = flower.Client(module, evaluation=evaluation)
    with monkeypatch.context() as m:
        _no_jax(m)
        replies = []
        for msg, want in grid.exchanged:
            pid = grid.contexts[msg.metadata.dst_node_id].node_config["partition-id"]
            replies.append((_reply_of(iree, msg, pid), want))
        msg0, _ = grid.exchanged[0]
        with pytest.raises(AssertionError, match="jax ran"):
            _reply_of(jax_client, msg0, 0)
    assert len(replies) == 2 * jax_template.NODES
    for got, want in replies:
        assert got.metadata.reply_to_message_id == want.metadata.reply_to_message_id
        g, w = got.content, want.content
        assert sorted(g.array_records) == sorted(w.array_records)
        for key in w.array_records:
            ga, wa = runtime.from_record(g[key]), runtime.from_record(w[key])
            assert sorted(ga) == sorted(wa)
            for k in wa:
                assert ga[k].dtype == wa[k].dtype and ga[k].shape == wa[k].shape, k
                np.testing.assert_allclose(ga[k], wa[k], rtol=1e-5, atol=1e-6, err_msg=k)
        assert dict(g["metrics"]) == pytest.approx(dict(w["metrics"]), rel=1e-5, abs=1e-6)
        assert g["metrics"]["num-examples"] == w["metrics"]["num-examples"]


def test_a_device_target_the_client_has_no_module_for_is_an_error_naming_what_it_has(template_round):
    from fcir.interpreters.production.iree_runtime import DeviceRuntimeError

    from fcir.errors import ExportError

    module, _, grid = template_round
    with pytest.raises(ExportError, match="choose jax or iree"):
        flower.Client(module, device_runtime="tpu")
    with pytest.raises(ExportError, match="device_runtime='iree'"):
        flower.Client(module, device_target="llvm-cpu")
    client = flower.Client(module, device_runtime="iree", device_target="aarch64-apple-ios17")
    msg = next(m for m, _ in grid.exchanged if m.metadata.message_type == "train")
    with pytest.raises(DeviceRuntimeError, match="llvm-cpu"):
        _reply_of(client, msg, 0)
