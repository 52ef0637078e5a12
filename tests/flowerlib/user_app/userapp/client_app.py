"""client_app.py: the round's client work from the user's own handlers."""

import functools

from fcir.interpreters import flower
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import fixedclipping_mod

from userapp.task import capture, load_data


@functools.cache
def work():
    module, evaluation = capture()
    return flower.Client(module, evaluation=evaluation)


def train_fn(msg: Message, context: Context):
    X, y, _, _ = load_data(context.node_config["partition-id"])
    return work().train(msg, X, y)


def evaluate_fn(msg: Message, context: Context):
    _, _, X_test, y_test = load_data(context.node_config["partition-id"])
    return work().evaluate(msg, X_test, y_test)


app = ClientApp()
app.train()(train_fn)
app.evaluate()(evaluate_fn)

# With DifferentialPrivacyClientSideFixedClipping on the server: Flower's mod clips
# each train reply's model update before it leaves the node.
dp_app = ClientApp()
dp_app.train(mods=[fixedclipping_mod])(train_fn)
dp_app.evaluate()(evaluate_fn)
