"""The pure functions behind every technique, usable without Lightning."""

from lightning_efficient._validate import format_bytes, parse_bytes
from lightning_efficient.techniques._blocks import find_repeated_blocks, select_modules

__all__ = ["find_repeated_blocks", "select_modules", "parse_bytes", "format_bytes"]
