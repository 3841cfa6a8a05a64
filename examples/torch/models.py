"""Models for the PyTorch examples, defined here because torchvision is not installed.

- :class:`DigitsCNN`: a small CNN for the 8x8 handwritten digits of scikit-learn.
- :func:`resnet18`, :func:`resnet50`: torchvision's ResNet architecture (He et al., 2016),
  with torchvision's parameter names (``conv1.weight``, ``layer1.0.bn1.weight``, ...
  ``fc.bias``), so ``resnet50().named_parameters()`` matches
  ``hipress/data/gradients/resnet50.json`` name for name and shape for shape.
- :func:`vgg19`: VGG-19 (Simonyan & Zisserman, 2015) with the naming of
  ``hipress/data/gradients/vgg19.json``: ``features.<i>`` is the i-th convolution (0..15)
  and ``classifier.<i>`` the i-th linear layer (0..2).
- :func:`bert_base`: the BERT-base encoder with its pooler (Devlin et al., 2019; 12 layers,
  hidden size 768, 12 heads, vocabulary 30522) with Hugging Face's parameter names, so
  its parameters match ``hipress/data/gradients/bert-base.json`` name for name, plus a
  linear ``classifier`` on the pooled output (sequence classification).

``build_model(name)`` returns one by name (``MODELS`` lists them), ``input_shape(name)``
the shape of one input (an image; for BERT a sequence of token ids) and
``synthetic_batch(name, ...)`` a random batch of inputs and labels.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple, Type, Union

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, a max-pool and two linear layers for 1x8x8 images.

    About 38k parameters; reaches ~98% test accuracy on scikit-learn's digits in a few
    seconds on a CPU.

    Args:
        num_classes: number of output logits.
        width: channels of the first convolution (the second has twice as many).
    """

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc1 = nn.Linear(2 * width * 4 * 4, 64)
        self.fc2 = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits of shape (batch, num_classes) for images of shape (batch, 1, 8, 8)."""
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


# ------------------------------------------------------------------------------ ResNet
def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a shortcut (ResNet-18/34)."""

    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1,
                 downsample: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.conv1 = _conv3x3(cin, width, stride)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class Bottleneck(nn.Module):
    """1x1 -> 3x3 -> 1x1 convolutions with a shortcut (ResNet-50/101/152, stride on the 3x3)."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1,
                 downsample: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.conv1 = _conv1x1(cin, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv1x1(width, width * self.expansion)
        self.bn3 = nn.BatchNorm2d(width * self.expansion)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the block's output (same layout as torchvision's Bottleneck)."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    """ResNet for 3x224x224 images, with torchvision's module and parameter names.

    Args:
        block: :class:`BasicBlock` or :class:`Bottleneck`.
        layers: number of blocks in each of the four stages.
        num_classes: output logits.
    """

    def __init__(self, block: Type[Union[BasicBlock, Bottleneck]], layers: List[int],
                 num_classes: int = 1000) -> None:
        super().__init__()
        self._cin = 64
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.layer1 = self._stage(block, 64, layers[0], 1)
        self.layer2 = self._stage(block, 128, layers[1], 2)
        self.layer3 = self._stage(block, 256, layers[2], 2)
        self.layer4 = self._stage(block, 512, layers[3], 2)
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def _stage(self, block: Type[Union[BasicBlock, Bottleneck]], width: int, blocks: int,
               stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self._cin != width * block.expansion:
            downsample = nn.Sequential(_conv1x1(self._cin, width * block.expansion, stride),
                                       nn.BatchNorm2d(width * block.expansion))
        mods = [block(self._cin, width, stride, downsample)]
        self._cin = width * block.expansion
        mods += [block(self._cin, width) for _ in range(1, blocks)]
        return nn.Sequential(*mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits of shape (batch, num_classes)."""
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, stride=2, padding=1)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet18(num_classes: int = 1000) -> ResNet:
    """Return ResNet-18 (11.7M parameters at 1000 classes)."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes)


def resnet50(num_classes: int = 1000) -> ResNet:
    """Return ResNet-50 (25.6M parameters, 161 tensors at 1000 classes)."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes)


# --------------------------------------------------------------------------------- VGG
_VGG19_STAGES = [[64, 64], [128, 128], [256, 256, 256, 256], [512, 512, 512, 512],
                 [512, 512, 512, 512]]


class VGG19(nn.Module):
    """VGG-19: 16 3x3 convolutions in five pooled stages, then three linear layers.

    143.7M parameters, 38 tensors at 1000 classes; each stage ends with a 2x2 max-pool.

    ``features`` holds the convolutions only and ``classifier`` the linear layers only, so
    the parameter names are ``features.0.weight`` .. ``features.15.bias`` and
    ``classifier.0.weight`` .. ``classifier.2.bias`` (the naming of the gradient tables).
    """

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        convs, self._pool_after, cin = [], set(), 3
        for stage in _VGG19_STAGES:
            for cout in stage:
                convs.append(nn.Conv2d(cin, cout, 3, padding=1))
                cin = cout
            self._pool_after.add(len(convs) - 1)
        self.features = nn.ModuleList(convs)
        self.classifier = nn.ModuleList([nn.Linear(512 * 7 * 7, 4096), nn.Linear(4096, 4096),
                                         nn.Linear(4096, num_classes)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits of shape (batch, num_classes) for 3x224x224 images."""
        for i, conv in enumerate(self.features):
            x = F.relu(conv(x))
            if i in self._pool_after:
                x = F.max_pool2d(x, 2)
        x = torch.flatten(F.adaptive_avg_pool2d(x, 7), 1)
        x = F.dropout(F.relu(self.classifier[0](x)), 0.5, self.training)
        x = F.dropout(F.relu(self.classifier[1](x)), 0.5, self.training)
        return self.classifier[2](x)


def vgg19(num_classes: int = 1000) -> VGG19:
    """Return VGG-19."""
    return VGG19(num_classes)


# -------------------------------------------------------------------------------- BERT
#: BERT-base's vocabulary (WordPiece, uncased)
BERT_VOCAB = 30522
#: sequence length of BERT's synthetic inputs when none is given
BERT_SEQ_LEN = 64


class BertEmbeddings(nn.Module):
    """Word + position + token-type embeddings, then LayerNorm (eps 1e-12)."""

    def __init__(self, vocab: int, hidden: int, max_positions: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(max_positions, hidden)
        self.token_type_embeddings = nn.Embedding(2, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)  # noqa: N815 (HF's name)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """(batch, seq) int64 token ids -> (batch, seq, hidden) float32."""
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = (self.word_embeddings(ids) + self.position_embeddings(pos)
             + self.token_type_embeddings(torch.zeros_like(ids)))
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    """Multi-head scaled dot-product self-attention (separate query, key, value maps)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, hidden) -> (batch, seq, hidden); every token attends to all."""
        b, t, h = x.shape

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, h // self.heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(self.query(x)), split(self.key(x)),
                                             split(self.value(x)))
        return out.transpose(1, 2).reshape(b, t, h)


class BertDenseNorm(nn.Module):
    """``LayerNorm(dense(x) + residual)``: BERT's attention and feed-forward outputs."""

    def __init__(self, d_in: int, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)  # noqa: N815 (HF's name)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """(batch, seq, d_in) and a (batch, seq, hidden) residual -> (batch, seq, hidden)."""
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    """Self-attention and its output projection (``attention.self``, ``attention.output``)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.self = BertSelfAttention(hidden, heads)
        self.output = BertDenseNorm(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, hidden) -> (batch, seq, hidden)."""
        return self.output(self.self(x), x)


class BertIntermediate(nn.Module):
    """The feed-forward block's first linear layer and GELU."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, hidden) -> (batch, seq, ffn)."""
        return F.gelu(self.dense(x))


class BertLayer(nn.Module):
    """One transformer encoder layer (post-LayerNorm, as in BERT)."""

    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.attention = BertAttention(hidden, heads)
        self.intermediate = BertIntermediate(hidden, ffn)
        self.output = BertDenseNorm(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, hidden) -> (batch, seq, hidden)."""
        x = self.attention(x)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    """A stack of :class:`BertLayer` (``encoder.layer.<i>``)."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(hidden, heads, ffn) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, hidden) -> (batch, seq, hidden)."""
        for layer in self.layer:
            x = layer(x)
        return x


class BertPooler(nn.Module):
    """``tanh(dense(first token))``."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, hidden) -> (batch, hidden)."""
        return torch.tanh(self.dense(x[:, 0]))


class BertBase(nn.Module):
    """BERT-base for sequence classification: embeddings, 12 layers, pooler, classifier.

    109.5M parameters in 199 tensors before the classifier (``bert-base.json``; the
    word embedding alone is 30522 x 768, 89.4 MiB of float32), plus ``classifier.weight``
    (num_classes x 768) and ``classifier.bias``. No dropout and no attention mask (every
    token is real), so a step is deterministic given its inputs. Input: token ids, int64,
    shape (batch, seq_len) with seq_len <= 512; every token has token type 0.
    """

    def __init__(self, num_classes: int = 2, vocab: int = BERT_VOCAB, hidden: int = 768,
                 layers: int = 12, heads: int = 12, ffn: int = 3072,
                 max_positions: int = 512) -> None:
        super().__init__()
        self.vocab = vocab
        self.embeddings = BertEmbeddings(vocab, hidden, max_positions)
        self.encoder = BertEncoder(layers, hidden, heads, ffn)
        self.pooler = BertPooler(hidden)
        self.classifier = nn.Linear(hidden, num_classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Return logits of shape (batch, num_classes) for token ids of shape (batch, seq)."""
        return self.classifier(self.pooler(self.encoder(self.embeddings(ids))))


def bert_base(num_classes: int = 2) -> BertBase:
    """Return BERT-base with a ``num_classes``-way classifier on the pooled output."""
    return BertBase(num_classes)


MODELS: Dict[str, Callable[..., nn.Module]] = {
    "digits_cnn": DigitsCNN,
    "resnet18": resnet18,
    "resnet50": resnet50,
    "vgg19": vgg19,
    "bert-base": bert_base,
}


def input_shape(name: str, image_size: int = 224, seq_len: int = BERT_SEQ_LEN) -> tuple:
    """Return the shape of one input of model ``name``.

    (channels, height, width) of an image; for ``bert-base`` (seq_len,) token ids.
    """
    if name == "bert-base":
        return (seq_len,)
    return (1, 8, 8) if name == "digits_cnn" else (3, image_size, image_size)


def synthetic_batch(name: str, batch_size: int, num_classes: int, generator: torch.Generator,
                    image_size: int = 224, seq_len: int = BERT_SEQ_LEN
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Return random inputs and labels for model ``name`` (benchmarks, no real data).

    Images: float32 of shape (batch_size, C, H, W), standard normal. BERT: int64
    token ids of shape (batch_size, seq_len), uniform over the vocabulary. Labels: int64
    of shape (batch_size,), uniform in [0, num_classes).
    """
    shape = input_shape(name, image_size, seq_len)
    if name == "bert-base":
        x = torch.randint(0, BERT_VOCAB, (batch_size, *shape), generator=generator)
    else:
        x = torch.randn(batch_size, *shape, generator=generator)
    return x, torch.randint(0, num_classes, (batch_size,), generator=generator)


def build_model(name: str, **kwargs: int) -> nn.Module:
    """Return a new model by name.

    Raises:
        ValueError: unknown name; the message lists :data:`MODELS`.
    """
    try:
        return MODELS[name](**kwargs)
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}") from None
