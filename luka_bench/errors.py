"""Bad input that stops a run with one line (``error: ...``, exit 2) instead of a traceback.

Each layer raises its own one-line error type (data: ``DataError``, methods: ``MethodConfigError``, models:
``ModelUnavailable``, run folders: ``RunFolderError``, prompts: ``PromptTooLong``); the command line
(``__main__``) and a sweep job (``run.run``) both ask ``one_line_errors()`` which of them to print as one line.
"""
from __future__ import annotations


class PromptTooLong(ValueError):
    """A prompt does not fit the model's context. One line."""


def one_line_errors() -> tuple[type[BaseException], ...]:
    # Imported here: the command line checks group names before anything heavy (torch, transformers) loads.
    from luka_bench.data.base import DataError
    from luka_bench.methods.base import MethodConfigError
    from luka_bench.models import ModelUnavailable
    from luka_bench.results import RunFolderError

    return (DataError, MethodConfigError, ModelUnavailable, RunFolderError, PromptTooLong)


def unwrap(e: BaseException) -> BaseException:
    """The error inside Hydra's ``InstantiationException`` wrappers (a bad method/data setting raised in a
    dataclass's ``__post_init__``)."""
    from hydra.errors import InstantiationException

    while isinstance(e, InstantiationException) and e.__cause__ is not None:
        e = e.__cause__
    return e
