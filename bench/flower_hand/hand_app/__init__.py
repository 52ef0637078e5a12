"""FedAvg on a two-layer MLP, written by hand for Flower (the benchmark baseline)."""
