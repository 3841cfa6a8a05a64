"""What the three digits examples share: command line, config overrides, data, sharding.

``examples/{torch,tensorflow,mxnet}/train_digits.py`` differ only in the framework code;
their flags, the way flags override the HiPress config, the train/test split and the
per-rank sharding come from here, so their accuracy tables compare.
"""

from __future__ import annotations

import argparse

import numpy as np

from hipress.adapter_common import parse_params


def argument_parser(description: str) -> argparse.ArgumentParser:
    """Return the parser of the flags every digits example accepts (add your own to it)."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--epochs", type=int, default=8, help="passes over the training set")
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    p.add_argument("--momentum", type=float, default=0.9,
                   help="SGD momentum (use 0 with --memory dgc, which applies DGC's momentum "
                   "correction itself)")
    p.add_argument("--compression", default=None,
                   help="codec name (none, onebit, tbq, terngrad, dgc, graddrop, powersgd, "
                   "fp16, topk, ...); default: the config's compression.algorithm")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="codec parameter, repeatable (e.g. --param ratio=0.01)")
    p.add_argument("--min-compress-bytes", type=int, default=None,
                   help="tensors smaller than this go uncompressed (config default: 65536)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="first N steps run uncompressed (config default: 0)")
    p.add_argument("--memory", default=None, choices=["auto", "none", "residual", "dgc"],
                   help="error feedback (config default: auto = residual for biased codecs)")
    p.add_argument("--test-fraction", type=float, default=0.25, help="share held out for test")
    p.add_argument("--seed", type=int, default=42, help="seed of the split, init and shuffles")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on rank 0")
    return p


def config_overrides(args: argparse.Namespace) -> dict:
    """Return the dotted config overrides the command line asks for."""
    out = {}
    if args.compression is not None:
        out["compression.algorithm"] = args.compression
        out["compression.params"] = parse_params(args.param)
    elif args.param:
        out["compression.params"] = parse_params(args.param)
    if args.min_compress_bytes is not None:
        out["compression.min_compress_bytes"] = args.min_compress_bytes
    if args.warmup_steps is not None:
        out["compression.warmup_steps"] = args.warmup_steps
    if args.memory is not None:
        out["compression.memory"] = args.memory
    return out


def load_data(test_fraction: float, seed: int):
    """Return (x_train, y_train, x_test, y_test): standardized float32 (n, 64) images, int labels.

    A stratified split of scikit-learn's digits (1,797 8x8 images, shipped with it),
    standardized with the training set's mean and standard deviation.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x.astype(np.float32), y, test_size=test_fraction,
                                              random_state=seed, stratify=y)
    mean, std = x_tr.mean(), x_tr.std()
    return (x_tr - mean) / std, y_tr, (x_te - mean) / std, y_te


def shard(n: int, epoch: int, seed: int, rank: int, size: int) -> np.ndarray:
    """Return this rank's sample indices for ``epoch``: equal counts on every rank."""
    perm = np.random.default_rng(seed * 1000 + epoch).permutation(n)
    return perm[rank::size][: n // size]
