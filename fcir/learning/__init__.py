"""``fcir.learning``: the federated learning algorithms people compare, each a program.

```python
import jax.numpy as jnp
import optax
from fcir import learning

def loss_fn(w, batch):                      # one batch of one client
    return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)

algo = learning.fedavg(loss_fn, client_optimizer=optax.sgd(0.1))
state = algo.init(jnp.zeros(3))             # {"params", "round"}: a pytree of arrays
rnd = algo.round(clients=4)                 # an @fcir.program
data = {"x": jnp.ones((4, 5, 8, 3)), "y": jnp.ones((4, 5, 8))}   # [clients, steps, batch, ...]
state, metrics = rnd(state, data)           # metrics["loss"]: the mean training loss
print(algo.params(state), metrics)
```

One module per algorithm (fedavg, fedavgm, fedprox, fedadam, fedyogi, fedadagrad,
fedopt, qfedavg, scaffold, diloco, fedsgd), the aggregators (``aggregator=``) in
``aggregators``, the algorithm object's skeleton in ``algorithm``, personalization
evaluation in ``personalization``. docs/learning.md has the table of what
each is in Flower, TFF and pfl-research and the backends each runs on.
"""

from fcir.errors import LearningError

from .aggregators import (
    Aggregator,
    bulyan,
    ddp,
    dp,
    dp_adaptive,
    geometric_median,
    krum,
    mean,
    median,
    multi_krum,
    trimmed_mean,
)
from .algorithm import Algorithm
from .diloco import diloco
from .personalization import personalized_evaluation
from .fedadagrad import fedadagrad
from .fedadam import fedadam
from .fedavg import fedavg
from .fedavgm import fedavgm
from .fedopt import fedopt
from .fedprox import fedprox
from .fedsgd import fedsgd
from .fedyogi import fedyogi
from .qfedavg import qfedavg
from .scaffold import scaffold

__all__ = [
    "Aggregator",
    "Algorithm",
    "LearningError",
    "bulyan",
    "ddp",
    "diloco",
    "dp",
    "dp_adaptive",
    "fedadagrad",
    "fedadam",
    "fedavg",
    "fedavgm",
    "fedopt",
    "fedprox",
    "fedsgd",
    "fedyogi",
    "geometric_median",
    "krum",
    "mean",
    "median",
    "multi_krum",
    "personalized_evaluation",
    "qfedavg",
    "scaffold",
    "trimmed_mean",
]
