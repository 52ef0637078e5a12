"""FedAvg of a small CIFAR-10 CNN written by hand for Flower (the benchmark baseline)."""
