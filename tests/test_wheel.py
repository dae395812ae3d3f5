"""An installed wheel works: `streamkit new` finds its templates outside the source checkout.

The templates live in the top-level templates/ folder and reach the wheel as the package
streamkit.templates (pyproject.toml maps it). This builds a wheel from a copy of the checkout,
installs it into a fresh virtual environment that borrows this environment's dependencies but
not its (editable) streamkit, and runs that environment's `streamkit new`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Not copied: other environments, caches and earlier build output (a stale build/ would leak
# files into the wheel). __pycache__ folders are copied: the wheel must leave them out.
_NOT_COPIED = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info",
                                     ".pytest_cache", ".ruff_cache", ".hypothesis", ".streamkit")


def _run(*args: str | Path, cwd: Path | None = None,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(arg) for arg in args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, f"{args}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _shipped(root: Path) -> set[str]:
    """The files under `root` a wheel must hold, relative to `root`."""
    return {path.relative_to(root).as_posix() for path in root.rglob("*")
            if path.is_file() and "__pycache__" not in path.parts}


def _build_wheel(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the checkout (the tree stays untouched) and the wheel built from it."""
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=_NOT_COPIED)
    stray = source / "templates" / "app" / "__pycache__"  # as a checkout may well have
    stray.mkdir(exist_ok=True)
    (stray / "stray.cpython-311.pyc").write_bytes(b"")
    # No build isolation: setuptools comes from this environment (the test extra), so
    # nothing is downloaded.
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index", "--no-build-isolation",
         "-q", "-w", tmp_path / "wheels", source)
    (wheel,) = (tmp_path / "wheels").glob("streamkit-*.whl")
    return source, wheel


def _check_contents(source: Path, wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    cached = [name for name in names if "__pycache__" in name or name.endswith(".pyc")]
    assert not cached, f"compiled files in the wheel: {cached}"
    tops = {name.split("/")[0] for name in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"streamkit"}  # no tests/...
    files = set(names)
    missing = {f"streamkit/{name}" for name in _shipped(source / "streamkit")} - files
    missing |= {f"streamkit/templates/{name}" for name in _shipped(source / "templates")} - files
    assert not missing, f"not in the wheel (pyproject.toml's packages or package-data?): {missing}"


def _make_venv(tmp_path: Path, wheel: Path) -> Path:
    """A virtual environment with the wheel installed, seeing this environment's packages.

    `venv --system-site-packages` would only see the base interpreter's packages, not this
    environment's, so a .pth file adds this environment's site-packages instead, after the new
    environment's own: the wheel's streamkit comes first, and the editable install's .pth file
    here is not processed (only site folders' .pth files are).
    """
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
         "-q", wheel)
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
                .stdout.strip())
    borrowed = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (site / "_streamkit_test_deps.pth").write_text("".join(f"{path}\n" for path in borrowed))
    return venv


def test_installed_wheel_streamkit_new(tmp_path: Path) -> None:
    source, wheel = _build_wheel(tmp_path)
    _check_contents(source, wheel)
    venv = _make_venv(tmp_path, wheel)
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    work = tmp_path / "work"
    work.mkdir()

    _run(venv / "bin" / "streamkit", "new", "myapp", cwd=work, env=env)
    app = work / "myapp"
    assert sorted(p.name for p in app.iterdir()) == [
        ".gitignore", "README.md", "app.py", "streamkit.yaml", "test_app.py"]
    # app.py imports with the wheel's streamkit, which found the templates inside the venv.
    check = ("import importlib.resources, app, streamkit\n"
             "assert issubclass(app.Myapp, streamkit.Application)\n"
             "print(streamkit.__file__)\n"
             "print(importlib.resources.files('streamkit.templates'))\n")
    shown = _run(venv / "bin" / "python", "-c", check, cwd=app, env=env).stdout.split()
    assert [Path(path).is_relative_to(venv) for path in shown] == [True, True], shown
