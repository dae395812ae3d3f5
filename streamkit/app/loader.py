"""Importing the user's Application class, named "module:Class" in streamkit.yaml.

This is the one place streamkit runs a user's code at import time, so it is
kept apart from reading the configuration. The app folder goes first on
``sys.path``; a failing import becomes one readable problem naming the
exception and the last line of the app's own code it went through, never a
traceback. Several app folders in one process (tests, the docs) each get
their own module even when the names clash (every template app has an
``app``), but a module that anything else imported is never replaced.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
import types
from pathlib import Path

from streamkit.app.application import Application
from streamkit.protocol.problems import Problem, SpecError

__all__ = [
    "ApplicationLoadError",
    "app_folder",
    "app_frames",
    "app_location",
    "app_traceback",
    "forget_app_modules",
    "import_application",
]

# The field of streamkit.yaml every problem here is about.
_FIELD = "application"


class ApplicationLoadError(SpecError):
    """The Application class a config names can't be loaded; problems point at its field."""


def _error(message: str, source: str) -> ApplicationLoadError:
    return ApplicationLoadError([Problem(message, _FIELD, source=source)])


def import_application(target: str, folder: Path, source: str) -> type[Application]:
    """Import ``target`` ("module:Class") from ``folder``; its Application subclass.

    ``source`` (the config file) is named by every problem, as is its
    ``application`` field. Raises ApplicationLoadError.
    """
    module_name, class_name = target.split(":")
    module = _import_from(folder, module_name, source)
    cls = getattr(module, class_name, None)
    if cls is None:
        raise _error(f"module {module_name!r} ({_file_of(module)}) has no {class_name!r}", source)
    if not isinstance(cls, type) or not issubclass(cls, Application):
        what = type(cls).__name__ if not isinstance(cls, type) else f"class {cls.__name__}"
        raise _error(
            f"{target} is not a subclass of streamkit.Application (it is a {what})", source
        )
    if cls is Application:
        raise _error(f"{target} is streamkit.Application itself: subclass it", source)
    return cls


# Modules import_application imported, and the folder each came from: another app's
# module of the same name (every template app has an `app`) is replaced, never
# a module imported by anything else.
_app_modules: dict[str, Path] = {}
# App folders this process put on sys.path (a process it starts may not want them there).
_app_folders: set[str] = set()


def path_without_app_folders() -> list[str]:
    """`sys.path` without the app folders loading apps put there: what a process started
    afresh to run one app needs, without other apps' modules shadowing anything."""
    return [p for p in sys.path if p not in _app_folders]


def forget_app_modules(folder: Path) -> None:
    """Forget every module imported from `folder` or another app folder, and take the
    other app folders off sys.path: the next load reads the app in `folder` as its files
    are now. A process that runs task after task (Spark's reused Python workers, under a
    driver kept up between backfills) would otherwise go on running the app as it was
    when its first task imported it, sibling modules included; on a cluster each job
    ships the app to a folder of its own, whose modules would be shadowed by the ones
    an earlier job's copy left in sys.modules."""
    kept = str(folder.resolve())
    apps = {kept, *_app_folders}
    prefixes = tuple(f"{path}{os.sep}" for path in apps)
    # A folder on sys.path inside an app folder (its .venv's site-packages, say) holds
    # libraries, maybe streamkit itself: their modules stay.
    inner = sorted((entry for entry in sys.path if entry.startswith(prefixes)), key=len,
                   reverse=True)
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name == "__main__" or not isinstance(path, str) or not path.startswith(prefixes):
            continue
        home = next((entry for entry in inner if path.startswith(entry + os.sep)), None)
        if home is None or home in apps:
            del sys.modules[name]
            _app_modules.pop(name, None)
    for other in _app_folders - {kept}:
        while other in sys.path:
            sys.path.remove(other)
    _app_folders.intersection_update({kept})


def _file_of(module: types.ModuleType) -> str:
    return str(getattr(module, "__file__", None) or module.__name__)


def _within(path: str | None, folder: Path) -> bool:
    return path is not None and Path(path).resolve().is_relative_to(folder)


# Streamkit's own code: never the app's, even in a checkout that holds the app.
_STREAMKIT = Path(__file__).resolve().parent.parent
_LIBRARIES = {"site-packages", "dist-packages"}  # a .venv in the app's folder holds these


def app_folder(cls: type) -> Path | None:
    """The folder the app's code was imported from (the app folder, for a class that
    `import_application` loaded): the sys.path entry its module's file lies under.
    None when the module has no file."""
    path = getattr(sys.modules.get(cls.__module__), "__file__", None)
    if not isinstance(path, str):
        return None
    root = Path(path).resolve().parent
    depth = cls.__module__.count(".") + (Path(path).stem == "__init__")
    return root.parents[depth - 1] if depth else root


def _own(path: str, folder: Path) -> bool:
    """Whether `path` is the app's own code: in its folder, neither streamkit nor a library."""
    if not _within(path, folder):
        return False
    resolved = Path(path).resolve()
    return (not resolved.is_relative_to(_STREAMKIT)
            and not _LIBRARIES.intersection(resolved.relative_to(folder).parts))


def app_frames(error: BaseException, folder: Path) -> list[traceback.FrameSummary]:
    """The frames of `error`'s traceback in the app's own code (in `folder`), outermost
    first: what tells the user which of their lines raised, without streamkit's frames."""
    return [f for f in traceback.extract_tb(error.__traceback__) if _own(f.filename, folder)]


def app_location(error: BaseException, folder: Path | None) -> str:
    """The last line of the app's code `error` went through, as " (at app.py:30)" (a path
    relative to `folder`); "" if none."""
    frames = app_frames(error, folder) if folder is not None else []
    if folder is None or not frames:
        return ""
    last = frames[-1]
    return f" (at {Path(last.filename).resolve().relative_to(folder.resolve())}:{last.lineno})"


def app_traceback(error: BaseException, folder: Path | None) -> str:
    """The app's frames of `error`'s traceback as Python prints them (`  File "…", line N,
    in hook` and the line), under a heading; "" if it went through none of the app's code."""
    frames = app_frames(error, folder) if folder is not None else []
    if not frames:
        return ""
    return ("\nTraceback of the application's code (most recent call last):\n"
            + "".join(traceback.format_list(frames)).rstrip("\n"))


def _forget_other_app(folder: Path, top: str, source: str) -> None:
    existing = sys.modules.get(top)
    if existing is None or _within(getattr(existing, "__file__", None), folder):
        return
    if top not in _app_modules:
        raise _error(
            f"module {top!r} is already imported from {_file_of(existing)}; "
            "rename the app's module",
            source,
        )
    for name in [n for n in sys.modules if n == top or n.startswith(f"{top}.")]:
        del sys.modules[name]


def _import_from(folder: Path, module_name: str, source: str) -> types.ModuleType:
    top = module_name.split(".")[0]
    if str(folder) in sys.path:
        sys.path.remove(str(folder))
    sys.path.insert(0, str(folder))
    _app_folders.add(str(folder))
    _forget_other_app(folder, top, source)
    importlib.invalidate_caches()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and (module_name + ".").startswith(err.name + "."):
            raise _error(f"no module {module_name!r} in {folder}", source) from None
        raise _import_failed(module_name, err, folder, source) from None
    except (Exception, SystemExit) as err:  # (sys.exit() at import ended the command mute)
        raise _import_failed(module_name, err, folder, source) from None
    _app_modules[top] = folder
    return module


def _import_failed(
    module_name: str, err: BaseException, folder: Path, source: str
) -> ApplicationLoadError:
    """The exception's text and the last line of the app's code it went through."""
    text = " ".join(str(err).split())
    # A SyntaxError's text already names file and line.
    where = "" if isinstance(err, SyntaxError) else app_location(err, folder)
    return _error(
        f"importing module {module_name!r} failed: {type(err).__name__}: {text}{where}", source
    )
