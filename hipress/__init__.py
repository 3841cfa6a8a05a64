"""HiPress: compression-aware gradient synchronization for data-parallel training.

After Bai et al., "Gradient Compression Supercharged High-Performance Data Parallel DNN
Training", SOSP 2021. The core is framework-neutral (NumPy on the CPU, CuPy on the GPU);
framework adapters are ``hipress.torch``, ``hipress.tensorflow`` and ``hipress.mxnet``.
"""

__version__ = "0.1.0"
