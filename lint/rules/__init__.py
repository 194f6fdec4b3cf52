"""The lint rules, one module per catalog code. Importing this package registers every rule."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    if _module.name.startswith("rlg"):
        importlib.import_module(f"{__name__}.{_module.name}")
