"""Optimus: pretraining dense and Mixture-of-Experts language models on PyTorch's own stack."""

__version__ = "0.1.0"
