from __future__ import annotations

import torch

from hydra_ddp import models


def test_mnist_cnn_has_the_seeds_shapes():
    cnn = models.MnistCNN()
    shapes = {name: tuple(p.shape) for name, p in cnn.named_parameters()}
    assert shapes["conv1.weight"] == (20, 1, 5, 5) and shapes["conv2.weight"] == (50, 20, 5, 5)
    assert shapes["fc1.weight"] == (500, 800) and shapes["fc2.weight"] == (10, 500)
    assert cnn(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_mnist_cnn_follows_the_input_size():
    assert models.MnistCNN(in_channels=3, image_size=32)(torch.zeros(1, 3, 32, 32)).shape == (1, 10)


def test_mlp():
    assert models.MLP(in_features=784, hidden=[32])(torch.zeros(3, 1, 28, 28)).shape == (3, 10)


def test_torchvision_classifier_takes_grayscale():
    net = models.torchvision_classifier("resnet18", num_classes=4, in_channels=1)
    assert net(torch.zeros(2, 1, 32, 32)).shape == (2, 4)


def test_tiny_gpt_is_causal_and_returns_logits_as_vocab_by_time():
    torch.manual_seed(0)
    gpt = models.TinyGPT(vocab_size=256, context=16, dim=32, depth=2, heads=4)
    x = torch.randint(0, 256, (2, 16))
    logits = gpt(x)
    # cross_entropy(logits, targets of (2, 16)): per-token losses
    assert logits.shape == (2, 256, 16)
    changed = x.clone()
    changed[:, 10] = (x[:, 10] + 1) % 256
    after = gpt(changed)
    # no position sees a later byte
    assert torch.allclose(logits[..., :10], after[..., :10], atol=1e-6)
    assert not torch.allclose(logits[..., 10:], after[..., 10:])
    assert gpt.shard_units() == list(gpt.blocks)  # FSDP's units: the blocks
