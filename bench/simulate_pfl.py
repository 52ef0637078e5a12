"""bench/simulate.py's pfl side: FedAvg of the CIFAR-10 CNN on pfl 0.6's PyTorch backend,
set up as pfl-research's own CIFAR-10 benchmark sets it up (benchmarks/image_classification,
config baseline.yaml): users as ``FederatedDataset.from_slices`` of torch tensors with a
random user sampler, ``PyTorchModel`` with local ``torch.optim.SGD`` and central SGD at
learning rate 1.0, ``SimulatedBackend`` weighting by user, ``FederatedAveraging`` with
``NNTrainHyperParams(local_learning_rate=0.1, local_num_epochs=1, local_batch_size=10)``.
Left out, as in every system here: dropout, and central evaluation (the benchmark
measures training rounds).

It runs in its own virtualenv (``.venv-pfl``: pfl 0.6 pins dp-accounting 0.5, fcir needs
0.6), as a worker of bench/simulate.py: it reads ``run N`` lines on stdin, runs N central
iterations and answers ``FCIR-BENCH {"seconds": ...}``; ``quit`` ends it.
The population is bench/cifar.py's (same seed, same data as the JAX systems).

    .venv-pfl/bin/python bench/simulate_pfl.py CLIENTS EXAMPLES COHORT BATCH [THREADS]

THREADS sets torch's intra-op threads (default: torch's own, one per core). On a
loaded machine it matters more than anything pfl does: with 2 threads on the 2 shared
cores at load 14-15, two rounds of 4 clients took 28-36 s, with 1 thread 1.7-2.9 s
(torch's OpenMP workers wait for each other when the scheduler takes one away).
"""

from __future__ import annotations

import json
import sys
import time
from importlib import metadata

import cifar  # bench/, the script's own folder
import torch
import torch.nn.functional as F
from pfl.aggregate.simulate import SimulatedBackend
from pfl.aggregate.weighting import WeightByUser
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
from pfl.data.federated_dataset import FederatedDataset
from pfl.data.sampling import get_user_sampler
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
from pfl.metrics import Weighted
from pfl.model.pytorch import PyTorchModel

PROTOCOL = "FCIR-BENCH"
LR = 0.1  # local_learning_rate of pfl's baseline.yaml, as hand_cifar/cnn.py's LR


class NHWCToNCHW(torch.nn.Module):
    def forward(self, x):
        return x.permute(0, 3, 1, 2)


class CNN(torch.nn.Sequential):
    """pfl-research's ``simple_cnn`` (benchmarks/model/pytorch/cnn.py), without dropout:
    the same layers as bench/flower_cifar/hand_cifar/cnn.py."""

    def __init__(self, shape=cifar.SHAPE, classes: int = cifar.CLASSES):
        flat = ((shape[0] - 4) // 2) * ((shape[1] - 4) // 2) * 64
        super().__init__(
            NHWCToNCHW(),
            torch.nn.Conv2d(shape[2], 32, 3), torch.nn.ReLU(),
            torch.nn.Conv2d(32, 64, 3), torch.nn.ReLU(),
            torch.nn.MaxPool2d(2), torch.nn.Flatten(),
            torch.nn.Linear(flat, 128), torch.nn.ReLU(),
            torch.nn.Linear(128, classes),
        )  # fmt: skip
        for m in self.modules():
            if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
                torch.nn.init.xavier_uniform_(m.weight)

    def loss(self, inputs, targets, eval=False):
        self.eval() if eval else self.train()
        return F.cross_entropy(self(inputs), targets.long())

    @torch.no_grad()
    def metrics(self, inputs, targets, eval=True):
        loss = self.loss(inputs, targets, eval) * len(inputs)
        return {"loss": Weighted(loss.item(), len(inputs))}


def setup(clients: int, examples: int, cohort: int, batch: int):
    torch.manual_seed(0)
    x, y = cifar.population(clients, examples)
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    users = {u: (tx[u], ty[u]) for u in range(clients)}
    dataset = FederatedDataset.from_slices(users, get_user_sampler("random", range(clients)))
    net = CNN(x.shape[2:])
    params = [p for p in net.parameters() if p.requires_grad]
    model = PyTorchModel(model=net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(params, 1.0))  # fmt: skip
    backend = SimulatedBackend(training_data=dataset, val_data=None,
                               postprocessors=[WeightByUser()])  # fmt: skip
    train = NNTrainHyperParams(local_learning_rate=LR,
                               local_num_epochs=1, local_batch_size=batch)  # fmt: skip
    evaluate = NNEvalHyperParams(local_batch_size=batch)

    def run(rounds: int) -> None:
        params = NNAlgorithmParams(central_num_iterations=rounds, evaluation_frequency=10**9,
                                   train_cohort_size=cohort, val_cohort_size=0)  # fmt: skip
        FederatedAveraging().run(algorithm_params=params, backend=backend, model=model,
                                 model_train_params=train, model_eval_params=evaluate,
                                 callbacks=[], send_metrics_to_platform=False)  # fmt: skip

    return run


def main() -> None:
    clients, examples, cohort, batch = (int(a) for a in sys.argv[1:5])
    if len(sys.argv) > 5:
        torch.set_num_threads(int(sys.argv[5]))
    run = setup(clients, examples, cohort, batch)
    versions = {d: metadata.version(d) for d in ("pfl", "torch", "numpy")}
    versions["torch_threads"] = torch.get_num_threads()
    print(PROTOCOL, json.dumps({"ready": True, "versions": versions}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        t = time.perf_counter()
        run(int(cmd[1]))
        print(PROTOCOL, json.dumps({"seconds": time.perf_counter() - t}), flush=True)


if __name__ == "__main__":
    main()
