"""Model-path confinement: which model directories a request may name, and which files a model directory may hold.

``/plan`` may only read model directories under the configured roots: ``..`` components, absolute paths elsewhere and
symlinks that lead out are refused. Inside a model directory, every file the server reads (its config, tokenizer
files, index and shards, all at the directory's top level) must also resolve, symlinks followed, under the allowed
roots (:func:`confine_model_files`): a link in a model directory cannot make the server read a file nobody allowed.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable, Sequence
from pathlib import Path

from service.errors import NotFoundError, RequestValidationError


class PathEscapeError(RequestValidationError):
    """A model path that points outside the configured model roots."""

    status_code = 403


#: Longest path and path component accepted (Linux's PATH_MAX and NAME_MAX): longer ones cannot name a file.
MAX_PATH_CHARS = 4096
MAX_NAME_CHARS = 255


def check_path_text(name: str) -> None:
    """Refuse a path no file system could hold, before any system call sees it (which would fail with OSError)."""
    if "\x00" in name or not name.strip():
        raise RequestValidationError("The model path is empty or contains a NUL byte.")
    if len(name) > MAX_PATH_CHARS or any(
        len(part.encode("utf-8", "replace")) > MAX_NAME_CHARS for part in name.split("/")
    ):
        raise RequestValidationError(
            f"The model path is longer than the OS allows ({MAX_PATH_CHARS} characters in all, {MAX_NAME_CHARS} "
            "bytes per component); name a directory under the model roots."
        )


def resolve_under_roots(name: str, roots: Iterable[str]) -> Path:
    """The real directory ``name`` names under one of ``roots``; refuse anything that would leave them."""
    real_roots = [Path(r).expanduser().resolve() for r in roots]
    if not real_roots:
        raise NotFoundError(
            "This server has no model roots configured, so /plan can only plan the served model or an inline "
            "config; start it with --model-root DIR to allow model directories."
        )
    check_path_text(name)
    path = Path(name)
    if ".." in path.parts:
        raise PathEscapeError(f"The model path {name!r} contains '..'; name a directory under the model roots.")
    candidates = [path] if path.is_absolute() else [root / path for root in real_roots]
    inside_any = False
    for candidate in candidates:
        try:
            real = candidate.resolve()
            if not any(real == root or real.is_relative_to(root) for root in real_roots):
                continue
            inside_any = True
            if real.is_dir():
                return real
        except (OSError, RuntimeError) as exc:  # a loop of symlinks (RuntimeError on 3.11), a refused component
            raise RequestValidationError(
                f"The model path {name!r} cannot be resolved: {path_error_reason(exc)}."
            ) from None
    if not inside_any:
        raise PathEscapeError(
            f"The model path {name!r} is outside the configured model roots (absolute path elsewhere, or a "
            "symlink that leads out); name a directory under the model roots."
        )
    raise NotFoundError(f"No model directory {name!r} under the model roots.")


def real_roots(roots: Iterable[str | Path]) -> list[Path]:
    """Configured roots as real directories (``~`` expanded, symlinks resolved), for comparing resolved paths."""
    return [Path(r).expanduser().resolve() for r in roots]


def is_under(real: Path, roots: Sequence[Path]) -> bool:
    """Whether the resolved path ``real`` is one of ``roots`` or inside one."""
    return any(real == root or real.is_relative_to(root) for root in roots)


def confine_model_files(directory: Path, roots: Sequence[Path], option: str) -> None:
    """Refuse a model directory, or any file at its top level (where config, tokenizer and weights are read from),
    that resolves outside ``roots``; ``option`` names the setting that widens them. Subdirectories are not read
    and not checked; a dangling link is judged by where it points."""

    def names() -> str:
        return ", ".join(str(r) for r in roots)

    try:
        real_dir = directory.resolve()
        if not is_under(real_dir, roots):
            raise PathEscapeError(
                f"The model directory {str(directory)!r} resolves to {str(real_dir)!r}, outside the allowed roots "
                f"({names()}); serve a model under them, or add its directory with {option}."
            )
        for entry in sorted(directory.iterdir()):
            real = entry.resolve()
            if real.is_dir():
                continue
            if not is_under(real, roots):
                raise PathEscapeError(
                    f"{str(entry)!r} is a link to {str(real)!r}, outside the allowed roots ({names()}); replace the "
                    f"link with the file, or add the directory it points into with {option}."
                )
    except (OSError, RuntimeError) as exc:  # a loop of links (RuntimeError on 3.11), an unreadable directory
        raise RequestValidationError(
            f"A file of the model directory cannot be read: {path_error_reason(exc)}."
        ) from None


def path_error_reason(exc: BaseException) -> str:
    """What went wrong with a path, without the server's own paths: ``resolve()`` names the real one it reached."""
    if isinstance(exc, RuntimeError) or getattr(exc, "errno", None) == errno.ELOOP:
        return "a loop of symbolic links, or a chain of them longer than the OS follows"
    return getattr(exc, "strerror", None) or type(exc).__name__
