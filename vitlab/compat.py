"""Old keyword names of public functions, refused with the new name for one release.

vitlab 0.2 gave every method one calling shape: the pixel batch is ``inputs`` (DETR's was
``pixel_values``), what is explained is ``target`` (DETR's was ``queries``), and a block index is
``block`` / ``start_block`` (were ``layer``, ``start_layer``, ``from_block``, ``first_block``,
``image_start_block`` / ``text_start_block``). A call with an old keyword raises ``TypeError:
"<function>: '<old>' was renamed to '<new>'"`` instead of Python's plain "unexpected keyword
argument", so code written for the previous release is told what to change.
"""
from __future__ import annotations

import functools

__all__ = ["moved_names", "renamed_arguments", "replaced_names"]


def renamed_arguments(**renames: str):
    """Decorator: calling the function with an old keyword (a key of ``renames``) raises
    ``TypeError("<function>: '<old>' was renamed to '<new>'")``, the new name its value.

    The signature seen by :func:`inspect.signature` and ``help`` stays the function's own.
    """
    for old, new in renames.items():
        if not isinstance(new, str) or not new or new == old:
            raise ValueError(f"renamed_arguments: {old}= needs the new name (a different non-empty str), got {new!r}")

    def wrap(fn):
        @functools.wraps(fn)
        def checked(*args, **kwargs):
            stale = sorted(renames.keys() & kwargs.keys())
            if stale:
                raise TypeError(f"{fn.__name__}: '{stale[0]}' was renamed to '{renames[stale[0]]}'")
            return fn(*args, **kwargs)

        checked.renamed_arguments = dict(renames)
        return checked

    return wrap


def moved_names(module: str, moves: dict[str, str]):
    """A module ``__getattr__`` for names that moved to another module: reading
    ``module.<name>`` raises ``AttributeError("<module>.<name> moved to <new module>.<name>")``
    (``moves``: name -> the module that holds it now); any other missing name gets Python's
    usual message."""
    return _refused_names(module, {name: f"{module}.{name} moved to {new}.{name}: import it from there"
                                   for name, new in moves.items()})


def replaced_names(module: str, replacements: dict[str, str]):
    """A module ``__getattr__`` for names that were replaced by another function: reading
    ``module.<name>`` raises ``AttributeError("<module>.<name> was replaced by <replacement>")``
    (``replacements``: name -> the replacement's full name); any other missing name gets Python's
    usual message."""
    return _refused_names(module, {name: f"{module}.{name} was replaced by {new}: call that instead"
                                   for name, new in replacements.items()})


def _refused_names(module: str, messages: dict[str, str]):
    """A module ``__getattr__`` raising ``AttributeError(messages[name])`` for the names of ``messages``,
    Python's usual message for any other missing name."""
    def __getattr__(name: str):
        if name in messages:
            raise AttributeError(messages[name])
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
