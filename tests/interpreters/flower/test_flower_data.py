"""Data for exported apps (fcir.interpreters.flower.data, ``fcir flower data``): the
server inputs file and node files, and flwr-datasets-style label partitions."""

from __future__ import annotations

import numpy as np
import pytest
from fcir.interpreters.flower import data
from flowerlib import inprocess, rounds

pytest.importorskip("flwr", reason="the Flower tests need flwr (pip install 'fcir[flower]')")


def _leaves(path) -> list:
    with np.load(path) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


def test_split_arguments_writes_what_the_app_reads_and_the_run_matches_run_bundle(tmp_path):
    r = rounds.corpus_round("fedavg_mlp")
    args = r.module.main.arg_structure.unflatten(r.leaves)
    server, nodes = data.split_arguments(r.module, args, tmp_path / "parts")
    assert [x.tobytes() for x in _leaves(server)] == [x.tobytes() for x in r.server_leaves]
    app = rounds.export(r, tmp_path / "app")
    plan = rounds.plan_of(app)
    assert len(nodes) == rounds.NODES
    for i, p in enumerate(nodes):
        assert [x.tobytes() for x in _leaves(p)] == [x.tobytes() for x in r.node_leaves(plan, i)]
    configs = {7 + i: {"partition-id": i, "data-path": str(p)} for i, p in enumerate(nodes)}
    out = tmp_path / "out.npz"
    inprocess.run(app, configs, {"output": str(out), "inputs": str(server)})
    assert [x.tobytes() for x in _leaves(out)] == [
        x.tobytes() for x in rounds.bundle_outputs(r, tmp_path / "b")
    ]


def test_flower_data_command_splits_example_args_and_checks_them(tmp_path, capsys):
    from fcir.cli import main

    assert main(["flower", "data", "examples/fedavg.py:fedavg_round", "-o", str(tmp_path)]) == 0
    assert "node0.npz..node7.npz" in capsys.readouterr().out
    (model,) = _leaves(tmp_path / "server_inputs.npz")
    x, y = _leaves(tmp_path / "node3.npz")
    assert model.shape == (16, 1) and x.shape == (32, 16) and y.shape == (32, 1)
    # An IR file needs the argument values; a wrong count of leaves is a clear error.
    np.savez(tmp_path / "two.npz", model, x)
    assert (
        main(
            [
                "flower",
                "data",
                "examples/fedavg.py:fedavg_round",
                "--inputs",
                str(tmp_path / "two.npz"),
                "-o",
                str(tmp_path / "o"),
            ]
        )
        == 1
    )
    assert "holds 2 array(s)" in capsys.readouterr().err


def _labelled(n=600, classes=5, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, 3)).astype(np.float32), "label": rng.integers(0, classes, n)}


def test_iid_partitioner_takes_contiguous_near_equal_shards():
    p = data.IidPartitioner(num_partitions=4)
    p.dataset = _labelled(10)
    sizes = [len(p.load_partition(i)["label"]) for i in range(4)]
    assert sizes == [3, 3, 2, 2]
    assert np.concatenate(p.partition_indices()).tolist() == list(range(10))
    assert np.array_equal(p.load_partition(1)["x"], p.dataset["x"][3:6])


def _skew(p: data.DirichletPartitioner) -> float:
    """Mean over partitions of the largest label's share."""
    shares = []
    for i in range(p.num_partitions):
        labels = p.load_partition(i)["label"]
        shares.append(np.bincount(labels).max() / len(labels))
    return float(np.mean(shares))


def test_dirichlet_partitioner_covers_every_example_once_and_skews_with_small_alpha():
    ds = _labelled()
    skews = {}
    for alpha in (0.1, 1000.0):
        p = data.DirichletPartitioner(
            num_partitions=6, partition_by="label", alpha=alpha, min_partition_size=5, seed=1
        )
        p.dataset = ds
        idx = np.concatenate(p.partition_indices())
        assert sorted(idx.tolist()) == list(range(600))  # a partition of the data set
        assert min(len(q) for q in p.partition_indices()) >= 5
        skews[alpha] = _skew(p)
        q = data.DirichletPartitioner(
            num_partitions=6, partition_by="label", alpha=alpha, min_partition_size=5, seed=1
        )
        q.dataset = ds
        assert all(
            np.array_equal(a, b) for a, b in zip(p.partition_indices(), q.partition_indices())
        )
    assert skews[0.1] > 0.6 and skews[1000.0] < 0.35, skews
    p = data.DirichletPartitioner(num_partitions=3, partition_by="y", alpha=1.0)
    p.dataset = ds
    with pytest.raises(ValueError, match="no array 'y'"):
        p.load_partition(0)
    with pytest.raises(ValueError, match="greater than zero"):
        data.DirichletPartitioner(num_partitions=3, partition_by="label", alpha=0.0)


def test_pad_partitions_gives_one_shape_and_a_mask():
    p = data.DirichletPartitioner(
        num_partitions=3, partition_by="label", alpha=0.5, min_partition_size=1, seed=0
    )
    p.dataset = _labelled(60)
    parts = [p.load_partition(i) for i in range(3)]
    stacked = data.pad_partitions(parts)
    size = max(len(q["label"]) for q in parts)
    assert stacked["x"].shape == (3, size, 3) and stacked["mask"].shape == (3, size)
    for i, q in enumerate(parts):
        n = len(q["label"])
        assert stacked["mask"][i].sum() == n and np.array_equal(stacked["x"][i, :n], q["x"])
        assert not stacked["x"][i, n:].any()


@pytest.mark.parametrize("partitioner", ["iid", "dirichlet", "pathological"])
def test_nodes_load_their_partition_of_a_dataset_padded_and_masked(partitioner, tmp_path):
    """Run config dataset + partitioner: node partition-id of num-partitions loads its
    partition as the flwr-datasets-style partitioner draws it (the same as
    fcir.interpreters.flower.data's, same seed), padded to the round's rows with the
    mask; the reply's num-examples is the partition's size, and a round weighing the
    masked client means by their example counts gives Flower's FedAvg result."""
    import jax.numpy as jnp
    from fcir.interpreters import flower, reference

    import fcir

    rng = np.random.default_rng(1)
    dataset = {"x": rng.normal(size=(90, 4)).astype(np.float32), "label": rng.integers(0, 5, 90)}
    np.savez(tmp_path / "data.npz", **dataset)
    make = {
        "iid": lambda: data.IidPartitioner(3),
        "dirichlet": lambda: data.DirichletPartitioner(3, "label", 0.5, min_partition_size=5),
        "pathological": lambda: data.PathologicalPartitioner(3, "label", 2),
    }[partitioner]
    p = make()
    p.dataset = dataset
    parts = [p.load_partition(i) for i in range(3)]
    if partitioner == "pathological":
        assert all(len(np.unique(q["label"])) <= 2 for q in parts)
    sizes = [len(q["x"]) for q in parts]
    padded = data.pad_partitions(parts, max(sizes) + 2)  # room to spare: padding is masked

    @fcir.program(placements={"clients": 3})
    def masked_fedavg(w, x, mask):
        def client(w, x, m):
            n = jnp.sum(m)
            return w + jnp.sum(x * m[:, None], axis=0) / n, n

        update, n = fcir.map_fn(client, (fcir.broadcast(w), x, mask))
        return fcir.reduce_weighted_mean(update, n)

    w = np.zeros(4, np.float32)
    module = fcir.capture(masked_fedavg, w, padded["x"], padded["mask"])
    app = flower.export(module, tmp_path / "app", inputs=[w])
    nodes = {50 + i: {"partition-id": i, "num-partitions": 3} for i in range(3)}
    config = {"dataset": str(tmp_path / "data.npz"), "dataset-fields": "x,mask",
              "partitioner": partitioner, "output": str(tmp_path / "o.npz")}
    if partitioner != "iid":
        config["partition-by"] = "label"
    if partitioner == "dirichlet":  # the app's Dirichlet keeps flwr-datasets' default minimum (10)
        config["alpha"] = 0.5
    grid = inprocess.run(app, nodes, config)
    counts = {r.content["fcir"]["partition-id"]: r.content["metrics"]["num-examples"]
              for _, r in grid.exchanged}
    assert counts == dict(enumerate(sizes))
    (got,) = _leaves(tmp_path / "o.npz")
    fedavg = sum(n * q["x"].mean(0) for n, q in zip(sizes, parts)) / sum(sizes)  # Flower's FedAvg
    np.testing.assert_allclose(got, fedavg, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, reference.run(module, w, padded["x"], padded["mask"]), rtol=1e-5, atol=1e-6)
