"""Triton kernels, each with a plain-torch reference and an autograd wrapper. Imports only torch and triton."""
