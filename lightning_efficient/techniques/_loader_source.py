"""Where Lightning gets a fit's loaders, for the techniques that change them (``DataLoaderTuning``,
``DevicePreload``, ``Curriculum``).

A user gives the train loader one of three ways: a datamodule's ``train_dataloader()``, the
module's own, or ``trainer.fit(model, train_dataloaders=loader)``. Lightning reads each of them
at the same moment, inside its argument-capturing context: the datamodule's hook, the module's, or
(for loaders given to ``fit``) its fit loop's source (``core._internals.fit_loader_source``).
``loader_source`` names the object and the attribute to wrap so that every loader Lightning reads,
whichever way it was given, passes through a technique.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_efficient.core._internals import fit_loader_source

__all__ = ["loader_source"]


def loader_source(trainer: Any, pl_module: Any, hook: str = "train_dataloader") -> Any:
    """``(owner, attribute)`` whose call returns the fit's loaders for ``hook``
    (``"train_dataloader"``/``"val_dataloader"``), in Lightning's order: the datamodule's hook,
    the loaders given to ``trainer.fit`` (the fit loop's source, ``"dataloader"``), the module's
    hook; ``None`` when there are none."""
    datamodule = trainer.datamodule
    if datamodule is not None:
        return (datamodule, hook) if is_overridden(hook, datamodule) else None
    direct = fit_loader_source(trainer, hook)
    if direct is not None:
        return direct, "dataloader"
    return (pl_module, hook) if is_overridden(hook, pl_module) else None
