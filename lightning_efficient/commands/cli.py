"""``lightning-efficient fit|validate|test|predict --config X.yaml``: LightningCLI with this package's
classes.

- Every callback and strategy of this package resolves by its short class name in yaml
  (``class_path: ActivationCheckpointing``) because importing the package registers them as
  subclasses.
- The model defaults to ``TinyGPT``, and the demo model to the demo's ``TextDataModule``; any
  LightningModule and LightningDataModule can be given by class path. A config that names another
  model and no ``data`` (or ``data: null``) trains on the model's own loaders, as with Lightning's
  CLI: the demo's data serves it only when the config asks for it.
- Bad configuration ends with a short ``error: ...`` message and exit code 2
  (:func:`exit_with_error`).
- The commands that are not trainer methods (``estimate``, ...) are the other modules of
  :mod:`lightning_efficient.commands`; its ``main`` runs them all.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable
from typing import Any, NoReturn

import lightning.pytorch as pl
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities.model_helpers import is_overridden

import lightning_efficient  # noqa: F401  (registers every callback and strategy for short names)
from lightning_efficient.core._internals import set_option_type
from lightning_efficient.core.validate import without_module_trees

__all__ = [
    "CONFIG_ERRORS",
    "DEMO",
    "NOISE",
    "EfficientCLI",
    "EpochBar",
    "RunConfigSaver",
    "exit_with_error",
    "quiet_known_noise",
    "reason_first",
]

#: The demo: the model a config that names none trains, and its data.
DEMO = {
    "model": "lightning_efficient.demos.TinyGPT",
    "data": "lightning_efficient.demos.TextDataModule",
}

#: Exceptions raised while building the objects of a config that are configuration mistakes.
CONFIG_ERRORS = (ValueError, TypeError, MisconfigurationException, ImportError)


class _ShortErrorParser(LightningArgumentParser):
    """Ends a bad command line or config with ``error: ...`` (no usage dump, exit code 2)."""

    def error(self, message: str, ex: Exception | None = None):  # type: ignore[override]
        if not getattr(self, "exit_on_error", True):
            return super().error(message, ex)
        exit_with_error(
            f"{message.strip()}\n(run `lightning-efficient fit --help` for the options)"
        )


class RunConfigSaver(SaveConfigCallback):
    """Saves the run's config under the logger's run folder (``version_N/config.yaml``), never
    over an existing file, and not at all when the run has no logger (``logger: false``), where
    Lightning would write ``./config.yaml`` into the working folder and replace whatever was
    there (a user's own config included)."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if trainer.logger is None:
            return
        super().setup(trainer, pl_module, stage)


class EpochBar(RichProgressBar):
    """Lightning's rich progress bar, whose epoch reads "Epoch 0" where Lightning's reads
    "Epoch 0/-2": a run bounded by ``max_steps`` alone has ``max_epochs == -1`` (no limit), and
    Lightning's bar shows ``max_epochs - 1`` as the last epoch. The CLI's default bar."""

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self.describe_epoch(trainer)

    def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_end(trainer, *args, **kwargs)  # (re)creates the bar on a resume
        self.describe_epoch(trainer)

    def describe_epoch(self, trainer: Any) -> None:
        """Name the epoch without a last one when the run sets none."""
        max_epochs = trainer.max_epochs
        if max_epochs is None or max_epochs >= 0 or self.progress is None:
            return
        if self.train_progress_bar_id is not None:
            text = f"Epoch {trainer.current_epoch}"
            width = len(self.validation_description)  # as Lightning pads it (no flicker)
            self.progress.update(self.train_progress_bar_id, description=f"{text:{width}}")


class EfficientCLI(LightningCLI):
    """LightningCLI over any LightningModule/DataModule (default: the TinyGPT demo)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.parsers: list[LightningArgumentParser] = []
        kwargs.setdefault("parser_class", _ShortErrorParser)
        kwargs.setdefault("model_class", pl.LightningModule)
        kwargs.setdefault("datamodule_class", None)  # `data` optional, as in Lightning's CLI
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_callback", RunConfigSaver)
        kwargs.setdefault("save_config_kwargs", {"overwrite": False})
        kwargs.setdefault("auto_configure_optimizers", False)
        super().__init__(*args, **kwargs)

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        kwargs.setdefault("epilog", classes_epilog())
        return super().init_parser(**kwargs)

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.set_defaults({key: {"class_path": path} for key, path in DEMO.items()})
        self.parsers.append(parser)  # one per subcommand
        for hook in _PARSER_HOOKS:
            hook(parser)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse; where the config names a model or data other than the demo's, parse again
        without the demo's defaults: jsonargparse keeps the init_args a new ``class_path`` shares
        with the one before it (the default's ``seq_len``, ``batch_size``, ... would reach the
        user's classes), and the demo's data serves the demo model only (another model without
        ``data`` trains on its own loaders, as with Lightning's CLI)."""
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        model, data = (getattr(config.get(k), "class_path", None) for k in DEMO)
        demo = {"model": model == DEMO["model"]}
        demo["data"] = demo["model"] and data == DEMO["data"]
        undo = {key: None for key, is_demo in demo.items() if not is_demo}
        if undo:
            for each in self.parsers:
                each.set_defaults(undo)
            super().parse_arguments(parser, args)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        for fn in _CONFIG_HOOKS:
            try:
                fn(config)
            except CONFIG_ERRORS as err:
                exit_with_error(f"invalid configuration: {err}")

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except CONFIG_ERRORS as err:
            exit_with_error(f"invalid configuration: {err}")

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        """The trainer, with :class:`EpochBar` in place of Lightning's default progress bar (a bar
        the config gives is kept as given). A fit with no data to train on ends here, before the
        trainer is built."""
        no_loader = not is_overridden("train_dataloader", self.model, pl.LightningModule)
        if self.subcommand in (None, "fit") and self.datamodule is None and no_loader:
            exit_with_error(
                f"the config gives no `data` and the model {type(self.model).__name__} defines "
                "no `train_dataloader()`: name a LightningDataModule under `data:` (the demo's "
                "text: `data: {class_path: lightning_efficient.demos.TextDataModule}`)"
            )
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        given = list((config.get("trainer") or {}).get("callbacks") or [])  # before the Trainer
        trainer = super().instantiate_trainer(**kwargs)  # (which extends that very list)
        bar = trainer.progress_bar_callback
        if type(bar) is RichProgressBar and all(cb is not bar for cb in given):
            trainer.callbacks[trainer.callbacks.index(bar)] = EpochBar()
        return trainer


def classes_epilog() -> str:
    """The package's callbacks and strategies, for ``--help``."""
    from lightning.pytorch.strategies import Strategy

    from lightning_efficient import TECHNIQUES

    callbacks = [c.__name__ for c in TECHNIQUES if not issubclass(c, Strategy)]
    strategies = [c.__name__ for c in TECHNIQUES if issubclass(c, Strategy)]
    return (
        "lightning-efficient callbacks (trainer.callbacks, class_path by short name): "
        f"{', '.join(callbacks) or 'none'}. "
        f"lightning-efficient strategies (trainer.strategy): {', '.join(strategies) or 'none'}."
    )


_NOISE = ("Not a valid subclass", "Expected a", "Subclass types expect", "Does not validate")


def reason_first(message: str) -> str:
    """jsonargparse explains a bad value inside a Union with every subtype it tried; the line
    that says what is wrong (e.g. "`every_n` must be >= 1; got -3.") goes first."""
    lines = message.strip().splitlines()
    reasons = [
        line.strip()[2:]
        for line in lines
        if line.strip().startswith("- ") and not line.strip()[2:].startswith(_NOISE)
    ]
    if not reasons or lines[0].strip() == reasons[0]:
        return message.strip()
    return reasons[0] + "\n\ndetails:\n" + "\n".join("  " + line for line in lines)


def exit_with_error(message: str) -> NoReturn:
    """End the command with ``error: <message>`` (its reason first; a module's printed tree as
    ``Name(...)``) and exit code 2."""
    print(f"error: {reason_first(without_module_trees(message))}", file=sys.stderr)
    raise SystemExit(2)


# -- parser and config hooks ---------------------------------------------------------------
def _precision_accepts_auto(parser: Any) -> None:
    """``trainer.precision`` also takes ``"auto"``; ``_resolve_precision`` checks the value."""
    set_option_type(
        parser,
        "--trainer.precision",
        int | str | None,
        help="'auto' (best for the device: bf16-mixed on Ampere+ GPUs and bf16 CPUs, 16-mixed on "
        "older GPUs, else 32-true) or a Lightning precision such as 'bf16-mixed'. (default: None)",
    )


def _resolve_precision(config: Any) -> None:
    from lightning_efficient.techniques.precision import resolve_precision

    trainer = config.get("trainer")
    if trainer is not None and trainer.get("precision") is not None:
        trainer["precision"] = resolve_precision(trainer["precision"], trainer.get("accelerator"))


def _stateful_callbacks_once(config: Any) -> None:
    """A stateful technique given twice in ``trainer.callbacks`` fails with the compatibility
    rule's message here, before Lightning's Trainer refuses it with its generic one."""
    from lightning_efficient.core.compat import stateful_twice
    from lightning_efficient.core.validate import SettingsError, import_object

    trainer = config.get("trainer")
    callbacks = trainer.get("callbacks") if trainer is not None else None
    if not isinstance(callbacks, list):
        return
    classes = []
    for callback in callbacks:
        path = callback.get("class_path") if hasattr(callback, "get") else None
        if isinstance(path, str) and "." in path:
            try:
                classes.append(import_object("trainer.callbacks", path))
            except ValueError:  # the parser says what is wrong with it
                continue
    message = stateful_twice(classes)
    if message:
        raise SettingsError(message)


#: Functions ``hook(parser)`` that add or change parser options.
_PARSER_HOOKS: list[Callable[[Any], None]] = [_precision_accepts_auto]

#: Functions ``hook(config)`` run on the parsed config before any class is built.
_CONFIG_HOOKS: list[Callable[[Any], None]] = [_resolve_precision, _stateful_callbacks_once]

#: Lines other libraries print on every run that tell the user of this command nothing to act
#: on: (logger name, message start) for log records, (None, message regex) for warnings.
NOISE: list[tuple[str | None, str]] = [
    # bitsandbytes (CPUs with AVX512-BF16) tries an optional Hub kernel for 4-bit matmuls, which
    # no technique here uses, and logs a warning when the `kernels` package is missing
    (
        "bitsandbytes.backends.cpu.ops",
        "Failed to load CPU gemm_4bit_forward from kernels-community",
    ),
    # Lightning advertises its cloud logger at every Trainer's start
    (
        "lightning.pytorch.utilities.rank_zero",
        "\N{ELECTRIC LIGHT BULB} Tip: For seamless cloud logging",
    ),
    (
        "lightning.fabric.utilities.rank_zero",
        "\N{ELECTRIC LIGHT BULB} Tip: For seamless cloud logging",
    ),
    # the model summary counts mixed-precision parameters as fp32, which they are
    (None, r"Precision .* is not supported by the model summary"),
    # Lightning's own use of a torch name that torch 2.10+ deprecates
    (None, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
]


class _DropMessages(logging.Filter):
    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


def quiet_known_noise() -> None:
    """Drop the lines of ``NOISE`` from this process's output (the command's process only: a
    filter on each logger named there, and a warnings filter per message; nothing else of
    those libraries changes)."""
    starts: dict[str, list[str]] = {}
    for logger, message in NOISE:
        if logger is None:
            warnings.filterwarnings("ignore", message=message)
        else:
            starts.setdefault(logger, []).append(message)
    for logger, messages in starts.items():
        target = logging.getLogger(logger)
        if not any(isinstance(f, _DropMessages) for f in target.filters):
            target.addFilter(_DropMessages(tuple(messages)))
