"""A Horovod PyTorch MNIST script ported to HiPress by changing one import.

The script follows the structure of Horovod's ``examples/pytorch/pytorch_mnist.py``
(written anew here): ``hvd.init()``, a ``DistributedSampler`` per rank, the learning rate
scaled by ``hvd.size()``, ``hvd.broadcast_parameters`` / ``hvd.broadcast_optimizer_state``,
``hvd.Compression.fp16`` on request, ``hvd.DistributedOptimizer`` with
``gradient_predivide_factor``, and test metrics averaged with ``hvd.allreduce``. The only
Horovod-specific line that changed is::

    import horovod.torch as hvd      ->      import hipress.torch as hvd

The data are scikit-learn's handwritten digits (1,797 8x8 images shipped with
scikit-learn, no download) instead of MNIST, so the network is sized for 8x8 inputs and
the defaults suit that small set (batch 16, momentum 0.9, 8 epochs; measured at 2 ranks
with ``--fp16-allreduce --gradient-predivide-factor 2``: 95.6% test accuracy after 4
epochs). Run it with::

    hipressrun -np 2 python examples/torch/pytorch_mnist.py --fp16-allreduce
    mpirun -np 2 python examples/torch/pytorch_mnist.py --gradient-predivide-factor 2

Rank 0 prints training progress and, after each epoch::

    Test set: Average loss: 0.1234, Accuracy: 96.44%
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F  # noqa: N812
import torch.optim as optim
import torch.utils.data.distributed

import hipress.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from digits_common import load_data  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="PyTorch digits example (Horovod style)")
    parser.add_argument("--batch-size", type=int, default=16, metavar="N",
                        help="input batch size for training")
    parser.add_argument("--test-batch-size", type=int, default=1000, metavar="N",
                        help="input batch size for testing")
    parser.add_argument("--epochs", type=int, default=8, metavar="N",
                        help="number of epochs to train")
    parser.add_argument("--lr", type=float, default=0.01, metavar="LR",
                        help="learning rate (scaled by the number of ranks)")
    parser.add_argument("--momentum", type=float, default=0.9, metavar="M", help="SGD momentum")
    parser.add_argument("--no-cuda", action="store_true", default=False,
                        help="disables CUDA training")
    parser.add_argument("--seed", type=int, default=42, metavar="S", help="random seed")
    parser.add_argument("--log-interval", type=int, default=10, metavar="N",
                        help="how many batches to wait before logging training status")
    parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                        help="use fp16 compression during allreduce")
    parser.add_argument("--gradient-predivide-factor", type=float, default=1.0,
                        help="apply gradient predivide factor in optimizer (default: 1.0)")
    parser.add_argument("--test-fraction", type=float, default=0.25,
                        help="share of the digits held out for testing")
    return parser.parse_args(argv)


class Net(nn.Module):
    """Two convolutions and two dense layers for 1x8x8 images, log-probabilities out."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.conv2_drop = nn.Dropout2d(0.1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        """Return log-probabilities (batch, 10) of images (batch, 1, 8, 8)."""
        x = F.relu(self.conv1(x))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, p=0.2, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def digits_datasets(test_fraction, seed):
    """Return (train, test) TensorDatasets of (1, 8, 8) float images and int64 labels."""
    x_tr, y_tr, x_te, y_te = load_data(test_fraction, seed)

    def dataset(x, y):
        return torch.utils.data.TensorDataset(torch.from_numpy(x).reshape(-1, 1, 8, 8),
                                              torch.from_numpy(y.astype("int64")))

    return dataset(x_tr, y_tr), dataset(x_te, y_te)


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def train(epoch, model, optimizer, train_loader, train_sampler, args):
    model.train()
    # Horovod: set epoch to sampler for shuffling.
    train_sampler.set_epoch(epoch)
    for batch_idx, (data, target) in enumerate(train_loader):
        if args.cuda:
            data, target = data.cuda(), target.cuda()
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
            # Horovod: use train_sampler to determine the number of examples in this shard.
            done, share = batch_idx * len(data), 100.0 * batch_idx / len(train_loader)
            print(f"Train Epoch: {epoch} [{done}/{len(train_sampler)} ({share:.0f}%)]\t"
                  f"Loss: {loss.item():.6f}", flush=True)


def test(model, test_loader, test_sampler, args):
    model.eval()
    test_loss = 0.0
    test_accuracy = 0.0
    with torch.no_grad():
        for data, target in test_loader:
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            output = model(data)
            # sum up batch loss
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            # get the index of the max log-probability
            pred = output.argmax(dim=1, keepdim=True)
            test_accuracy += pred.eq(target.view_as(pred)).cpu().float().sum().item()

    # Horovod: use test_sampler to determine the number of examples in this worker's partition.
    test_loss /= len(test_sampler)
    test_accuracy /= len(test_sampler)

    # Horovod: average metric values across workers.
    test_loss = metric_average(test_loss, "avg_loss")
    test_accuracy = metric_average(test_accuracy, "avg_accuracy")

    # Horovod: print output only on first rank.
    if hvd.rank() == 0:
        print(f"\nTest set: Average loss: {test_loss:.4f}, "
              f"Accuracy: {100.0 * test_accuracy:.2f}%\n", flush=True)
    return test_accuracy


def main(argv=None):
    args = parse_args(argv)
    args.cuda = not args.no_cuda and torch.cuda.is_available()

    # Horovod: initialize library.
    hvd.init()
    torch.manual_seed(args.seed)

    if args.cuda:
        # Horovod: pin GPU to local rank.
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)

    # Horovod: limit # of CPU threads to be used per worker.
    torch.set_num_threads(1)

    train_dataset, test_dataset = digits_datasets(args.test_fraction, args.seed)
    # Horovod: use DistributedSampler to partition the training data.
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    # Horovod: use DistributedSampler to partition the test data.
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    test_loader = torch.utils.data.DataLoader(
        test_dataset, batch_size=args.test_batch_size, sampler=test_sampler)

    model = Net()

    # By default, scale the learning rate by the number of workers.
    lr_scaler = hvd.size()

    if args.cuda:
        # Move model to GPU.
        model.cuda()

    # Horovod: scale learning rate by lr_scaler.
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(optimizer,
                                         named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Average,
                                         gradient_predivide_factor=args.gradient_predivide_factor)

    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        train(epoch, model, optimizer, train_loader, train_sampler, args)
        accuracy = test(model, test_loader, test_sampler, args)
    return accuracy


if __name__ == "__main__":
    main()
