"""ftkit: serve large Mixture-of-Experts models on one GPU, a big host RAM and a CPU."""

__version__ = "0.1.0"
