"""Executors: a step's flat arrays in, sampled tokens out (``base.Executor``), one per backend:
``numpy_executor`` (the CPU reference) and ``cuda_executor`` (CuTe DSL kernels, CUDA graphs).
``registry`` names the backends, resolves "auto" and builds the executor of one.
"""
