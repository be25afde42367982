"""Demo workload: a plain LightningModule and DataModule that import nothing of this package."""

from lightning_efficient.demos.text import ByteChunks, EpochShuffle, TextDataModule, load_corpus
from lightning_efficient.demos.tinygpt import TinyGPT

__all__ = ["TinyGPT", "TextDataModule", "ByteChunks", "EpochShuffle", "load_corpus"]
