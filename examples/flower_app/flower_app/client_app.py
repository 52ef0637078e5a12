"""client_app.py: the round's client work, and its evaluation, in the ClientApp's own
handlers."""

import functools

from fcir.interpreters import flower
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import fixedclipping_mod

from flower_app.task import capture, load_data


@functools.cache
def work():
    module, evaluation = capture()
    return flower.Client(module, evaluation=evaluation)


app = ClientApp()


@app.train()
def train_fn(msg: Message, context: Context):
    X, y, _, _ = load_data(context.node_config["partition-id"])
    return work().train(msg, X, y)  # was: load_model, set_params, train, the reply


@app.evaluate()
def evaluate_fn(msg: Message, context: Context):
    _, _, X_test, y_test = load_data(context.node_config["partition-id"])
    return work().evaluate(msg, X_test, y_test)


# With DifferentialPrivacyClientSideFixedClipping on the server: Flower's mod clips
# each train reply's model update before it leaves the node.
dp_app = ClientApp()
dp_app.train(mods=[fixedclipping_mod])(train_fn)
dp_app.evaluate()(evaluate_fn)
